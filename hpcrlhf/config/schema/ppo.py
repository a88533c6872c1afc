"""The ppo job: its objective (`ppo`), its critic, and the checks across its sections (estimator and
groups, batch sizes, the Ray runtime, sleep between phases). Where its roles run: `placement`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from hpcrlhf.algos.estimators import ADVANTAGE_ESTIMATORS, ESTIMATORS, Estimator
from hpcrlhf.config.schema.checks import PathText, fill_derived, largest_divisor, require, require_finite, shown
from hpcrlhf.config.schema.agent import AgentConfig
from hpcrlhf.config.schema.online import OnlineJobConfig, require_agent_settings, source_name
from hpcrlhf.config.schema.placement import PlacementConfig
from hpcrlhf.config.schema.sections import MICRO_BATCH_CAP, EvalConfig, LogConfig, OptimConfig, TrainConfig
from hpcrlhf.errors import ConfigError

@dataclass(frozen=True)
class CriticConfig:
    path: PathText | None = None
    """Model the critic starts from. Unset: the first reward model in reward.sources (head kept),
    else the actor's model.path (a new value head)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3, scheduler="constant", warmup_ratio=0.0))
    """The critic's optimizer and schedule."""


@dataclass(frozen=True)
class PPOSectionConfig:
    advantage_estimator: Literal[ADVANTAGE_ESTIMATORS] = "gae"
    """gae: a critic and GAE (PPO); grpo: group-normalised scores (Shao et al. 2024); dr_grpo:
    group-centred scores, no std division (Liu et al. 2025; pair it with
    ppo.loss_aggregation=seq-mean-token-sum, the paper's constant normaliser); rloo: leave-one-out
    baseline (Ahmadian et al. 2024); reinforce++: globally whitened returns (Hu 2025);
    reinforce_baseline: score minus its prompt's mean, whitened over the batch (OpenRLHF). All but
    gae need no critic; grpo, dr_grpo, rloo and reinforce_baseline need
    rollout.samples_per_prompt >= 2."""
    epochs: int = 1
    """Passes over each rollout's experience (mini-batches of train.global_batch_size sequences)."""
    clip_eps: float = 0.2
    """Clip the probability ratio to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float | None = None
    """Upper clip range (null: clip_eps); a larger value lets rare good tokens grow (DAPO)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """token: PPO's per-token probability ratio; sequence: GSPO (Zheng et al. 2025), one ratio per
    response (the geometric mean of its token ratios) clipped as a whole -- use it with a
    sequence-level estimator (grpo, dr_grpo, rloo), clip ranges like the paper's (clip_eps 3e-4,
    clip_eps_high 4e-4) and loss_aggregation seq-mean-token-mean."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (Ye et al. 2020)."""
    value_clip: float | None = 0.2
    """Clip the critic's new values to old +- value_clip in the value loss (null: no clipping)."""
    gamma: float = 1.0
    """Discount factor over response tokens."""
    lam: float = 0.95
    """GAE lambda (bias/variance trade-off of the advantages)."""
    whiten_advantages: bool = True
    """Standardise advantages over the rollout (gae, rloo, reinforce_baseline; reinforce++ always does)."""
    entropy_coef: float = 0.0
    """Bonus on the policy's token entropy (0: none)."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """How token losses become the batch loss: mean over all tokens, mean over sequences of their
    token mean, or sum over each sequence's tokens divided by the number of sequences. The last is
    Dr. GRPO's constant normaliser (Liu et al. 2025); TRL's `loss_type="dr_grpo"` (1.16) also divides
    by `max_completion_length`, so its loss and gradients are ours / rollout.max_new_tokens: Adam's
    steps are the same, but gradient clipping is not -- TRL's max_grad_norm g matches
    optim.max_grad_norm = g x rollout.max_new_tokens here (and its logged grad norm is ours /
    rollout.max_new_tokens)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL(actor || reference) estimate: k1 log-ratio, k2 half squared log-ratio, k3
    exp(-r) - 1 + r (non-negative, unbiased). Each token's estimate is bounded to [-10, 10] (the log-
    ratio first to [-20, 20]), as OpenRLHF and verl bound theirs: one token the actor made far less
    likely than the reference cannot outweigh the batch."""
    init_kl_coef: float = 0.05
    """Coefficient of the KL penalty subtracted from the per-token rewards (0: none)."""
    kl_target: float | None = None
    """Adaptive KL controller target per sequence (Ziegler et al. 2019); null: fixed coefficient."""
    kl_horizon: int = 10000
    """Adaptive KL controller horizon, in sequences."""
    kl_loss_coef: float = 0.0
    """Coefficient of a KL term added to the policy loss instead (GRPO style, with kl_estimator)."""
    buffer_limit: int = 0
    """Replay buffer size in sequences: 0 keeps only the latest rollout; more also replays older
    experience (its importance ratio uses the log-probs it was generated with)."""
    freeze_actor_steps: int = 0
    """Train only the critic for the first N steps (warms the value estimates up)."""
    tis_cap: float | None = None
    """Truncated importance sampling (Yao et al. 2025): weight each token's policy loss by
    min(pi_old / pi_rollout, tis_cap), pi_rollout the rollout engine's log-prob of the token (it
    differs from the trainer's recomputation by the engine's numerics -- bf16 vLLM on GPU -- and,
    with rollout.max_staleness 1, by the update the generating weights missed). null: off; 2 is
    usual. Logged: rollout/is_weight (mean), rollout/is_truncated (share of tokens at the cap)."""
    is_mode: Literal["truncate", "mask", "seq_mask"] = "truncate"
    """How tis_cap corrects (hpcrlhf.algos.ppo.importance_weights), r = pi_old / pi_rollout per token:
    "truncate" weights each token by min(r, tis_cap) (TIS); "mask" weights it by r where r lies in
    [is_floor, tis_cap] and drops it (weight 0) elsewhere (masked IS, verl's token mode); "seq_mask"
    drops a whole response whose geometric-mean r leaves that band and truncates the others' tokens
    (verl's geometric mode). A dropped token still counts in the loss's denominator. Logged with a
    mask: rollout/is_masked (share of tokens dropped), rollout/is_masked_seq (share of responses)."""
    is_floor: float | None = None
    """Lower bound of r, in (0, 1]: "truncate" raises smaller weights to it (slime's tis_clip_low);
    the mask modes' band starts there. null: no floor for "truncate", 1 / tis_cap for the masks."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025): drop every prompt whose samples all got the same
    score (a group-relative estimator learns nothing from it) and refill the step with the groups of
    further prompts, generated in more rounds, until the step has rollout.prompts_per_step
    informative prompts. Needs rollout.samples_per_prompt >= 2. With rollout.max_staleness k the first
    round is the step's batch generated k steps ahead, the refills are generated with the current
    weights. Logged: rollout/generation_rounds,
    rollout/dropped_groups, rollout/extra_samples, rollout/uninformative_kept."""
    dynamic_sampling_filter: str = "score"
    """What must differ within a group for dynamic sampling to keep it: "score" (the reward sources'
    weighted sum before the penalties -- length, missing EOS, overlong --: DAPO's accuracy when the
    source is a correctness rule), "shaped" (the score after the penalties), or one source's metric
    name (`rule_task`, `model1_rm`, as in reward/<name>: its own values, weight aside). To filter on a
    check that is no part of the reward, add it as a source with weight 0."""
    dynamic_sampling_max_rounds: int = 4
    """Generation rounds per step at most (the first included); a step still short of informative
    prompts after them is filled with dropped ones (counted in rollout/uninformative_kept) rather
    than stopping the run."""

    def __post_init__(self) -> None:
        require_finite(self, "ppo")
        require(self.dynamic_sampling_max_rounds >= 1, "ppo.dynamic_sampling_max_rounds",
                self.dynamic_sampling_max_rounds, "use at least 1 (the step's first round)")
        require(self.tis_cap is None or self.tis_cap >= 1, "ppo.tis_cap", self.tis_cap,
                "use null (off) or a cap >= 1 such as 2 (a cap below 1 would down-weight every token)")
        require(self.is_mode == "truncate" or self.tis_cap is not None, "ppo.is_mode", self.is_mode,
                "it drops tokens whose weight pi_old/pi_rollout lies outside [ppo.is_floor, ppo.tis_cap], but "
                "ppo.tis_cap is null (no correction): set ppo.tis_cap=2, or ppo.is_mode=truncate")
        require(self.is_floor is None or 0 < self.is_floor <= 1, "ppo.is_floor", self.is_floor,
                "use a value in (0, 1], or null (none for truncate, 1/tis_cap for the mask modes)")
        require(self.is_floor is None or self.tis_cap is not None, "ppo.is_floor", self.is_floor,
                "it bounds the importance weights from below, but ppo.tis_cap is null (no correction): set "
                "ppo.tis_cap=2, or ppo.is_floor=null")
        require(self.epochs >= 1, "ppo.epochs", self.epochs, "use at least 1")
        require(0 < self.clip_eps < 1, "ppo.clip_eps", self.clip_eps, "use a value in (0, 1), typically 0.2")
        require(self.clip_eps_high is None or self.clip_eps_high > 0, "ppo.clip_eps_high", self.clip_eps_high,
                "use a positive value, or null")
        require(self.dual_clip is None or self.dual_clip > 1, "ppo.dual_clip", self.dual_clip, "use c > 1 (e.g. 3), or null")
        require(self.value_clip is None or self.value_clip > 0, "ppo.value_clip", self.value_clip, "use > 0, or null")
        require(0 <= self.gamma <= 1, "ppo.gamma", self.gamma, "use a value in [0, 1]")
        require(0 <= self.lam <= 1, "ppo.lam", self.lam, "use a value in [0, 1]")
        require(self.init_kl_coef >= 0, "ppo.init_kl_coef", self.init_kl_coef, "use >= 0")
        require(self.kl_loss_coef >= 0, "ppo.kl_loss_coef", self.kl_loss_coef, "use >= 0")
        require(self.kl_target is None or self.kl_target > 0, "ppo.kl_target", self.kl_target, "use > 0, or null")
        require(self.kl_horizon >= 1, "ppo.kl_horizon", self.kl_horizon, "use at least 1")
        require(self.entropy_coef >= 0, "ppo.entropy_coef", self.entropy_coef, "use >= 0")
        require(self.buffer_limit >= 0, "ppo.buffer_limit", self.buffer_limit, "use 0 (latest rollout only) or more")
        require(self.freeze_actor_steps >= 0, "ppo.freeze_actor_steps", self.freeze_actor_steps, "use >= 0")

    @property
    def estimator(self) -> Estimator:
        return ESTIMATORS[self.advantage_estimator]

    @property
    def uses_critic(self) -> bool:
        return self.estimator.needs_critic

    @property
    def uses_reference(self) -> bool:
        """A KL term (reward penalty or loss) needs the reference's log-probs."""
        return self.init_kl_coef > 0 or self.kl_loss_coef > 0


@dataclass(frozen=True)
class PPOConfig(OnlineJobConfig):
    """Online RL from rewards: PPO with a critic, or critic-free GRPO / RLOO / REINFORCE++."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-5, scheduler="constant", warmup_ratio=0.0))
    """The actor's optimizer and schedule (RL wants small steps: a fresh Adam moves every weight by
    about lr at first, which at SFT learning rates undoes what SFT taught)."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_steps=100, global_batch_size=None))
    """`max_steps`/`epochs` count rollouts (PPO steps) and passes over the prompts;
    `global_batch_size` is the mini-batch (sequences per optimizer step; null: derived from the
    rollout, see TrainConfig)."""
    derives_mini_batch: ClassVar[bool] = True
    uses_router_loss: ClassVar[bool] = True
    ppo: PPOSectionConfig = field(default_factory=PPOSectionConfig)
    """The PPO objective and its tricks."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (advantage_estimator gae)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Roles on the nodes and GPUs of a cluster allocation (`hpcrlhf plan` checks and prints it)."""
    agent: AgentConfig | None = None
    """Multi-turn rollouts: the model calls tools and an environment answers (docs/design/agents.md).
    null: one response per prompt."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(every_steps=20))
    """Evaluation during and after training."""
    log: LogConfig = field(default_factory=lambda: LogConfig(every_steps=1))
    """Metrics, TensorBoard and progress output."""
    output_dir: PathText = "runs/ppo"
    """Run folder: config.yaml, metrics.jsonl, TensorBoard files, checkpoints/, model/ (the actor)."""

    def multi_turn(self) -> AgentConfig | None:
        return self.agent

    def critic_source(self) -> tuple[str, str]:
        """(config field, path) of the model the critic starts from: `critic.path`, else the first
        reward model, else the policy (`model.path`)."""
        if self.critic.path:
            return "critic.path", self.critic.path
        rewards = self.reward_models()
        return rewards[0] if rewards else ("model.path", self.model.path)

    def __post_init__(self) -> None:
        super().__post_init__()
        est, n = self.ppo.advantage_estimator, self.rollout.samples_per_prompt
        if self.ppo.estimator.needs_groups and n < 2:
            raise ConfigError(f"rollout.samples_per_prompt: {n} gives {est} no group to compare within: "
                              f"use at least 2 (e.g. 4), or ppo.advantage_estimator=gae")
        names = [source_name(i, src) for i, src in enumerate(self.reward.sources)]
        require(self.ppo.dynamic_sampling_filter in ("score", "shaped", *names), "ppo.dynamic_sampling_filter",
                self.ppo.dynamic_sampling_filter,
                f"use score, shaped or a reward source's name ({', '.join(names)})")
        if self.ppo.dynamic_sampling and n < 2:
            raise ConfigError(f"ppo.dynamic_sampling: true drops prompts whose samples all scored the same, but "
                              f"rollout.samples_per_prompt is {n}: use at least 2 samples per prompt (e.g. 4), or "
                              "ppo.dynamic_sampling=false")
        k = self.rollout.max_staleness
        require(not self.rollout.partial or self.ppo.tis_cap is not None, "rollout.partial", True,
                "a paused sample goes on under newer weights than its first tokens', which the per-token ratios must "
                "correct: set ppo.tis_cap=2 (truncated importance weights; ppo.is_mode=mask to drop outlying tokens "
                "instead), or rollout.partial=false")
        if self.placement.runtime == "ray":
            require(not self.rollout.min_engine_step_s or self.rollout.partial or self.rollout.stream_order == "arrival",
                    "rollout.min_engine_step_s", self.rollout.min_engine_step_s,
                    "on Ray the engine actors run on engine loops with rollout.partial or rollout.stream_order arrival "
                    "only: set one of them, or rollout.min_engine_step_s=0")
        if k >= 2 and self.ppo.tis_cap is None:
            raise ConfigError(f"rollout.max_staleness: {k} trains on samples up to {k} updates old without correcting "
                              "their per-token ratios: set ppo.tis_cap=2 (truncated importance weights; "
                              "ppo.is_mode=mask to drop outlying tokens instead), or rollout.max_staleness=1")
        sequences = self.rollout.prompts_per_step * n
        if self.train.global_batch_size is None:
            fill_derived(self, "train", global_batch_size=largest_divisor(sequences, MICRO_BATCH_CAP))
        if sequences % self.train.global_batch_size:
            raise ConfigError(
                f"train.global_batch_size: {shown(self.train.global_batch_size)} does not divide the "
                f"{shown(sequences)} sequences of a rollout (rollout.prompts_per_step "
                f"{shown(self.rollout.prompts_per_step)} x samples_per_prompt {shown(n)}); "
                f"use a divisor of {shown(sequences)}")
        _require_sleep_settings(self)
        require_agent_settings(self.agent, self.reward, self.rollout)
        if self.agent is not None and self.agent.reward_placement == "turn":
            require(not self.ppo.estimator.sequence_level, "agent.reward_placement", "turn",
                    f"ppo.advantage_estimator {self.ppo.advantage_estimator} scores a trajectory as a whole: use "
                    "agent.reward_placement=end with it, or a token-level estimator (gae, reinforce++)")
            require(any(s.env and s.weight for s in self.reward.sources), "agent.reward_placement", "turn",
                    "it places the environment's turn rewards, but no reward source with a weight is the "
                    "environment's: add {env: true} to reward.sources, or use agent.reward_placement=end")
        for i, source in self.served_sources():
            require(self.placement.runtime == "ray", f"reward.sources[{i}].servers", source.servers,
                    "the job starts reward servers where the Ray runtime's node map places them: set "
                    "placement.runtime=ray (with rollout.backend=vllm), or servers=0 to score in the job, or start "
                    "`hpcrlhf serve-reward` yourself and give the source its url")
        if self.placement.runtime == "ray":
            require(self.rollout.backend == "vllm", "rollout.backend", self.rollout.backend,
                    "the Ray runtime generates with vLLM engines on their own workers: set rollout.backend=vllm "
                    "and placement.vllm.engines, or placement.runtime=local to generate with the actor")
            require(not self.lora.rank, "lora.rank", self.lora.rank,
                    "the Ray runtime pushes full weights into vLLM after each update: use lora.rank=0, or "
                    "placement.runtime=local")


def _require_sleep_settings(cfg: PPOConfig) -> None:
    """Sleep (placement.vllm.sleep, placement.<role>.sleep) swaps GPU memory between generation and
    training: it needs vLLM engines, trained roles that hold their states on the GPU, and phases
    that take turns."""
    p = cfg.placement
    sleepers = [f"placement.{name}.sleep" for name in ("actor", "critic", "ref", "reward") if getattr(p, name).sleep]
    sleepers += ["placement.vllm.sleep"] if p.vllm.sleep else []
    for key in sleepers:
        role = key.split(".")[1]
        if role in ("ref", "reward"):
            raise ConfigError(f"{key}: true, but only trained roles (actor, critic) sleep; a frozen role keeps its "
                              f"weights in CPU memory with placement.{role}.offload_params=true (ZeRO-3)")
        if cfg.rollout.backend != "vllm":
            raise ConfigError(f"{key}: true swaps GPU memory between vLLM generation and training, but "
                              f"rollout.backend is {cfg.rollout.backend!r} (the actor generates itself): set "
                              f"{key}=false, or rollout.backend=vllm")
        if cfg.rollout.max_staleness:
            raise ConfigError(f"{key}: true swaps GPU memory between generation and training, but "
                              f"rollout.max_staleness {cfg.rollout.max_staleness} runs them at the same time: use "
                              f"rollout.max_staleness=0 with sleep, or {key}=false")
        if cfg.rollout.min_engine_step_s:
            raise ConfigError(f"{key}: true swaps GPU memory between generation and training, but "
                              "rollout.min_engine_step_s runs the engine on an engine loop, which never sleeps: "
                              f"use one or the other (rollout.min_engine_step_s=0, or {key}=false)")
        offload = getattr(p, role).offload_params if role != "vllm" else None
        if offload or (offload is None and role != "vllm" and cfg.engine.offload_params):
            source = f"placement.{role}.offload_params" if offload else "engine.offload_params"
            raise ConfigError(f"{key}: true moves the role's states off the GPU while vLLM generates, but its "
                              f"weights are kept in CPU memory already ({source}): set {source}=false, or {key}=false")
