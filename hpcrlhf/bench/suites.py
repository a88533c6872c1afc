"""Benchmark suites: which systems run, on which models, lengths, batches and hardware.

Every system of a suite runs the same PPO step (actor, critic, reference and reward model; GAE)
on the same prompts, with fixed-length responses (`rollout.min_new_tokens = max_new_tokens`),
the same rollout batch, the same optimizer batches and PPO epochs, so that their samples/s
compare the systems and nothing else. What differs is only where the models live and what
generates:

- `hpcrlhf-distributed`: every role on its own ranks (Ray, by the node map), vLLM engines.
- `hpcrlhf-colocated`: every role and the vLLM engine(s) on the same devices.
- `dschat-style`: DeepSpeed-Chat step 3's design (microsoft/DeepSpeedExamples,
  applications/DeepSpeed-Chat): all four models on every device under ZeRO-3, generation by the
  training actor itself with Hugging Face `generate` (`synced_gpus`), DSChat's per-device batch
  sizes -- hpcrlhf's own trainer with `placement.runtime: local`, launched on every device.
  benchmarks/README.md lists each setting against DSChat's.
- `trl-grpo`: TRL's online RL trainer (GRPOTrainer; TRL 1.x has no PPO trainer) on every device,
  when `trl` is installed (hpcrlhf/bench/trl_system.py); skipped, and said so, when it is not.
- `hpcrlhf-local`: every role in each device's process (hpcrlhf's local runtime), HF generate:
  the layout whose work matches DSChat's and TRL's process for process.

Every suite computes in bf16, CPU ones included: real DeepSpeed-Chat accepts no fp32 on CPU, and
a CPU with AMX runs bf16 matmuls ~4x faster than fp32, so an fp32 system beside it would lose
on the dtype, not on its design.

Suites named `cpu*` run here; `gpu-*` suites are for clusters and need `--model` (and
`--reward-model`) folders of the right size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from hpcrlhf.algos.estimators import CRITIC_FREE
from hpcrlhf.bench.schedule import LengthDist
from hpcrlhf.config.recipe_yaml import quoted
from hpcrlhf.errors import ConfigError

SystemKind = Literal["hpcrlhf", "dschat-style", "trl"]

# DeepSpeed-Chat step 3 defaults (main.py; run_13b.sh uses the same): per-device generation and
# training batch 16, one generation batch, one PPO epoch; ZeRO-3 for actor and critic in its
# 13B scripts (reference and reward follow them to ZeRO-3).
DSCHAT_PER_DEVICE_BATCH = 16
# DSChat's hard-coded PPO constants (ppo_trainer.py), used by every system so the maths match.
DSCHAT_KL = 0.1  # kl_ctl
DSCHAT_PPO = (f"ppo.init_kl_coef={DSCHAT_KL}", "reward.clip=5.0", "ppo.clip_eps=0.2", "ppo.value_clip=0.2", "ppo.gamma=1.0",
              "ppo.lam=0.95", "ppo.epochs=1", "ppo.advantage_estimator=gae")


@dataclass(frozen=True)
class System:
    name: str
    kind: SystemKind
    recipe: str | None = None
    """Shipped recipe (or YAML path) the system starts from; None: the defaults."""
    overrides: tuple[str, ...] = ()
    """`--set` values of this system on top of the suite's common ones (kind "trl": extra
    arguments of `python -m hpcrlhf.bench.trl_system`)."""
    scaling: tuple[str, float] | None = None
    """(axis, value) when the system is a point of the scaling plot, e.g. ("vLLM engines", 2)."""
    about: str = ""
    samples_per_prompt: int = 1
    """Responses per distinct prompt. The suite's prompts_per_step counts responses, so every
    system generates and trains on as many sequences per step; a group estimator (GRPO: 2, TRL's
    smallest group) draws them for prompts_per_step / samples_per_prompt distinct prompts."""
    needs: tuple[str, ...] = ()
    """Python packages the system cannot run without (e.g. vllm): where one is missing the runner
    skips the system and says which, rather than failing half-way."""
    tail_steps: int = 0
    """Steps run after the measured ones and dropped: a system generating k steps ahead launches nothing in
    its last k steps, which would flatter it (k)."""

    @property
    def trains_critic(self) -> bool:
        """Whether a critic is trained each step (PPO with GAE); TRL's GRPO and the hpcrlhf GRPO
        systems train the actor alone."""
        if self.kind == "trl":
            return False
        chosen = [o.split("=", 1)[1] for o in self.overrides if o.startswith("ppo.advantage_estimator=")]
        return not (chosen and chosen[-1] in CRITIC_FREE)

    @property
    def all_ranks(self) -> bool:
        """Whether this system runs one process per device (DSChat-style, TRL, hpcrlhf's local
        runtime) rather than the Ray driver placing roles itself."""
        return self.kind != "hpcrlhf" or "placement.runtime=local" in self.overrides


@dataclass(frozen=True)
class Suite:
    name: str
    about: str
    hardware: Literal["cpu", "gpu"]
    nodes: int
    gpus_per_node: int
    """The allocation every system runs on (declared GPUs on CPU)."""
    prompt_tokens: int
    response_tokens: int
    prompts_per_step: int
    warmup_steps: int
    steps: int
    """Measured steps after the warm-up ones (medians over these)."""
    systems: tuple[System, ...]
    model: str | None = "builtin:tiny-llama"
    """Actor, reference and (unless `reward_model`) reward model; None: the user must give --model."""
    reward_model: str | None = None
    precision: Literal["fp32", "bf16"] = "bf16"
    gradient_checkpointing: bool = False
    dschat_ranks: int | None = None
    """Ranks of the all-devices baseline (default: nodes x gpus_per_node; CPU suites: 2, one per
    core, as the colocated layout's 2 declared devices)."""
    extra: tuple[str, ...] = field(default=())
    """`--set` values common to every system."""
    lengths: LengthDist | None = None
    """Long-tail suites: each prompt's response length drawn from this (seeded: the same prompts file, so the
    same lengths, for every system; `rollout.length_key`), up to response_tokens; None: every response has
    response_tokens tokens (DSChat's protocol)."""

    @property
    def devices(self) -> int:
        """Devices samples/device/s divides by: the allocation's GPUs, or 1 for a CPU host (every
        system shares the same cores; the GPUs a CPU suite declares are placement labels)."""
        return 1 if self.hardware == "cpu" else self.nodes * self.gpus_per_node

    @property
    def ranks(self) -> int:
        return self.dschat_ranks or self.nodes * self.gpus_per_node

    @property
    def train_batch(self) -> int:
        """Sequences per optimizer step: DSChat's per-device training batch on every rank."""
        return DSCHAT_PER_DEVICE_BATCH * self.ranks

    def system(self, name: str) -> System:
        for s in self.systems:
            if s.name == name:
                return s
        raise ConfigError(f"--systems: suite {self.name} has no system '{name}'; its systems: "
                          f"{', '.join(s.name for s in self.systems)}")

    def common_overrides(self, prompts_path: str) -> list[str]:
        """`--set` values every system of the suite runs with (paths -- `--model`, the run folder's
        prompts -- quoted: taken literally)."""
        model, reward = quoted(self.model), quoted(self.reward_model or self.model)
        return [
            f"model.path={model}", f"reward.sources=[{{model: {reward}}}]", f"critic.path={reward}",
            "task.name=null", f"data.train_path={quoted(prompts_path)}", f"data.max_length={self.prompt_tokens}",
            f"rollout.prompts_per_step={self.prompts_per_step}", "rollout.samples_per_prompt=1",
            f"rollout.max_new_tokens={self.response_tokens}",
            *([f"rollout.min_new_tokens={self.response_tokens}"] if self.lengths is None else
              [f"rollout.length_key={LENGTH_KEY}", "rollout.min_new_tokens=0"]),
            f"train.global_batch_size={self.train_batch}", f"train.max_steps={self.warmup_steps + self.steps}",
            f"engine.precision={self.precision}", f"engine.gradient_checkpointing={str(self.gradient_checkpointing).lower()}",
            "eval.every_steps=0", "eval.score_prompts=0", "log.every_steps=1", "log.backends=[]",
            "log.progress=false", "checkpoint.save_model=false", "checkpoint.at_end=false", *DSCHAT_PPO, *self.extra,
        ]

    def overrides_for(self, system: System, prompts_path: str) -> list[str]:
        """Every `--set` value of `system`'s job: the suite's, then the system's own."""
        group = [] if system.samples_per_prompt == 1 else [
            f"rollout.prompts_per_step={self.prompts_per_step // system.samples_per_prompt}",
            f"rollout.samples_per_prompt={system.samples_per_prompt}"]
        tail = [f"train.max_steps={self.warmup_steps + self.steps + system.tail_steps}"] if system.tail_steps else []
        return self.common_overrides(prompts_path) + group + list(system.overrides) + tail

    def with_model(self, model: str | None, reward_model: str | None) -> Suite:
        """The suite on the user's models; a suite without a model needs one."""
        suite = replace(self, model=model or self.model, reward_model=reward_model or self.reward_model)
        if suite.model is None:
            raise ConfigError(f"--model: suite {self.name} has no bundled model; give --model PATH (a local Hugging Face "
                              f"folder of the shape it is named after) and --reward-model PATH")
        return suite


LENGTH_KEY = "length"
"""The prompt-row field of a long-tail suite's response lengths."""


def dschat_style(ranks: int, *, offload_reference: bool = False, zero_stage: int = 3) -> System:
    """DSChat step 3's design; `zero_stage`: 3 as its multi-GPU scripts, 0 as its single-GPU ones
    (training_scripts/*/single_gpu: actor and critic ZeRO stage 0)."""
    extra = ("reference.offload=true",) if offload_reference else ()
    return System("dschat-style", "dschat-style", None,
                  ("placement.runtime=local", "rollout.backend=hf", f"engine.zero_stage={zero_stage}",
                   f"rollout.hf_batch_size={DSCHAT_PER_DEVICE_BATCH}", f"train.micro_batch_size={DSCHAT_PER_DEVICE_BATCH}",
                   *extra),
                  about=f"DeepSpeed-Chat step 3 design: 4 models x {ranks} rank(s), ZeRO-{zero_stage}, HF generate by "
                        "the actor")


# GRPO as TRL's GRPOTrainer runs it by default (trl 1.16 GRPOConfig): group-normalised scores
# (scale_rewards="group"), no critic, the KL to the reference as a k3 term in the loss with
# beta = the suite's KL coefficient, clip 0.2, every token of the batch weighted alike
# (loss_type="dapo": token-mean), one epoch, 2 responses per prompt (trl_system.py).
GRPO_GROUP = 2  # GRPO's smallest group: responses per prompt of trl-grpo and the hpcrlhf GRPO systems
GRPO_AS_TRL = ("ppo.advantage_estimator=grpo", "ppo.init_kl_coef=0", f"ppo.kl_loss_coef={DSCHAT_KL}",
               "ppo.kl_estimator=k3", "ppo.loss_aggregation=token-mean", "ppo.clip_eps=0.2")


def trl_grpo(*args: str) -> System:
    """TRL's GRPOTrainer on every rank; `args`: trl_system options (ZeRO stage, vLLM)."""
    how = "TRL's colocated vLLM" if "--use-vllm" in args else "HF generate by the policy"
    zero = next((f"ZeRO-{a.split('=')[1]}" for a in args if a.startswith("--zero-stage=")), "DDP")
    return System("trl-grpo", "trl", None, tuple(args), needs=("trl",), samples_per_prompt=GRPO_GROUP,
                  about=f"TRL GRPOTrainer on every rank ({zero}): {how}, reference + reward model, no critic "
                        "(less work per sample than PPO)")


def hpcrlhf_local(*, grpo: bool = False) -> System:
    """hpcrlhf's local runtime on every device: every role in each rank's process, HF generate by
    the actor in one batch (no vLLM), ZeRO-0 -- the layout for models that fit a device many
    times over; with `grpo`, trl-grpo's settings (no critic): the row to compare with TRL."""
    base = ("placement.runtime=local", "rollout.backend=hf", "engine.zero_stage=0", "rollout.hf_batch_size=64",
            f"train.micro_batch_size={DSCHAT_PER_DEVICE_BATCH}")
    about = "every role on every rank (local runtime), HF generate by the actor in batches of 64 (no vLLM), ZeRO-0"
    if not grpo:
        return System("hpcrlhf-local", "hpcrlhf", None, base, about=about)
    return System("hpcrlhf-local-grpo", "hpcrlhf", None, (*base, *GRPO_AS_TRL), samples_per_prompt=GRPO_GROUP,
                  about="hpcrlhf-local running GRPO with trl-grpo's settings (no critic): the row to compare with TRL")


# -- CPU: 2 declared nodes x 4 declared GPUs on this host ------------------------------------------
_CPU_REWARD = ("placement.reward={nodes: 2, gpus_per_node: 1}", "placement.colocate=[[actor, ref], [critic, reward]]")
_CPU_MICRO = f"train.micro_batch_size={DSCHAT_PER_DEVICE_BATCH}"
_CPU_SYSTEMS = (
    System("hpcrlhf-distributed", "hpcrlhf", "ppo-tiny-ray", (*_CPU_REWARD, _CPU_MICRO), ("vLLM engines", 2),
           "Ray: actor+ref, critic+reward on 2 ranks each, 2 vLLM engines (TP 2), over 2 nodes"),
    System("hpcrlhf-colocated", "hpcrlhf", "ppo-tiny-ray-colocated",
           ("placement.reward={nodes: 1, gpus_per_node: 2}", "placement.colocate=[[actor, critic, ref, reward, vllm]]",
            _CPU_MICRO),
           about="Ray: every role and one vLLM engine (TP 2) on the same 2 devices"),
    dschat_style(2),
    trl_grpo(),
    System("hpcrlhf-colocated-grpo", "hpcrlhf", "ppo-tiny-ray-colocated",
           ("placement.reward={nodes: 1, gpus_per_node: 2}", "placement.critic.gpus_per_node=0",
            "placement.colocate=[[actor, ref, reward, vllm]]", _CPU_MICRO, *GRPO_AS_TRL),
           samples_per_prompt=GRPO_GROUP,
           about="hpcrlhf-colocated running GRPO with trl-grpo's settings (no critic): the row to compare with TRL"),
    hpcrlhf_local(),
    hpcrlhf_local(grpo=True),
)
_CPU_SCALING = System("hpcrlhf-distributed-1-engine", "hpcrlhf", "ppo-tiny-ray",
                      (*_CPU_REWARD, _CPU_MICRO, "placement.vllm.engines=1", "placement.allow_idle_gpus=true"),
                      ("vLLM engines", 1), "hpcrlhf-distributed with one vLLM engine")
_CPU_STALE = System("hpcrlhf-distributed-stale1", "hpcrlhf", "ppo-tiny-ray",
                    (*_CPU_REWARD, _CPU_MICRO, "rollout.max_staleness=1"),
                    about="hpcrlhf-distributed generating each next rollout while the roles train (rollout.max_staleness=1)")

# -- long-tail lengths: the local runtime's vLLM engine, GRPO as TRL runs it, sync against k steps ahead ------
_LONGTAIL_GROUP = 4


def longtail_systems(kv_cache_gb: int, min_step_s: float = 0.0, names: Sequence[str] | None = None) -> tuple[System, ...]:
    """hpcrlhf's local runtime with a vLLM engine (`kv_cache_gb`), GRPO as TRL runs it (4 samples per prompt):
    synchronous, then k steps ahead on the engine loop, without and with partial rollouts. `min_step_s`: every
    system's engine steps at least that long (rollout.min_engine_step_s: a larger model's decode, emulated);
    `names`: only those systems (None: all)."""
    base = ("placement.runtime=local", "rollout.backend=vllm", "engine.zero_stage=0",
            f"rollout.vllm_kv_cache_gb={kv_cache_gb}", f"train.micro_batch_size={DSCHAT_PER_DEVICE_BATCH}",
            *GRPO_AS_TRL, *((f"rollout.min_engine_step_s={min_step_s}",) if min_step_s else ()))

    def system(name: str, k: int, partial: bool, about: str, order: str = "plan", stale: str = "drop") -> System:
        ahead = (f"rollout.max_staleness={k}", "ppo.tis_cap=2", *(("rollout.partial=true",) if partial else ()),
                 *((f"rollout.stream_order={order}",) if order != "plan" else ()),
                 *((f"rollout.stale_groups={stale}",) if stale != "drop" else ()))
        return System(name, "hpcrlhf", None, (*base, *(ahead if k else ())), samples_per_prompt=_LONGTAIL_GROUP,
                      needs=("vllm",), about=about, tail_steps=k)

    systems = (system("sync", 0, False, "synchronous: each step generates its batch, then trains on it"),
               system("k1", 1, False, "one step ahead on the engine loop: each sync waits for what runs (the drain)"),
               system("k2-partial", 2, True, "two steps ahead, samples under way paused at each sync and continued"),
               system("k4-partial", 4, True, "four steps ahead, partial rollouts"),
               system("k2-arrival-partial", 2, True, "two steps ahead, partial rollouts, each step trains the first "
                      "groups that end (rollout.stream_order=arrival)", "arrival"),
               system("k2-arrival-keep", 2, True, "k2-arrival-partial keeping groups grown older than k (trained when "
                      "they end: rollout.stale_groups=keep) instead of dropping them", "arrival", "keep"))
    known = [s.name for s in systems]
    if names is not None and set(names) - set(known):
        raise ValueError(f"longtail_systems: no system {sorted(set(names) - set(known))}; there are {known}")
    return systems if names is None else tuple(s for s in systems if s.name in names)


_SHORT_LIST = ("sync", "k2-partial", "k2-arrival-partial")
"""The long-tail systems of the suites that cannot afford all: synchronous, plan order and arrival order, k = 2."""


# -- GPU: the shipped OpenRLHF-style layouts against DSChat-style on the same allocation -------------
# OpenRLHF's benchmark (OpenRLHF/OpenRLHF benchmark/README.md) used 1024-token prompts and answers.
_GPU = dict(hardware="gpu", prompt_tokens=1024, response_tokens=1024, prompts_per_step=1024, warmup_steps=1, steps=3,
            model=None, gradient_checkpointing=True)


def _gpu_systems(recipe: str, nodes: int, gpus: int, engines_tp: tuple[int, int],
                 trl: tuple[str, ...] = ("--zero-stage=3", "--use-vllm")) -> tuple[System, ...]:
    engines, tp = engines_tp
    every = f"{{nodes: {nodes}, gpus_per_node: {gpus}}}"
    return (
        System("hpcrlhf-distributed", "hpcrlhf", recipe, about=f"{recipe}: separate roles, vLLM engines (OpenRLHF layout)"),
        System("hpcrlhf-colocated", "hpcrlhf", recipe,
               tuple(f"placement.{r}={every}" for r in ("actor", "critic", "ref", "reward"))
               + (f"placement.vllm={{engines: {engines}, tensor_parallel_size: {tp}, gpu_memory_utilization: 0.35}}",
                  "placement.colocate=[[actor, critic, ref, reward, vllm]]", "engine.zero_stage=3"),
               about=f"every role on all {nodes * gpus} GPUs, {engines} vLLM engines of TP {tp} beside them"),
        dschat_style(nodes * gpus, offload_reference=True),
        trl_grpo(*trl),
    )


# -- GPU, one device: what a lent single-GPU machine can show (benchmarks/gpu-check.sh) --------------
_GPU1_EVERY = "{nodes: 1, gpus_per_node: 1}"
_GPU1_SYSTEMS = (
    System("hpcrlhf-colocated", "hpcrlhf", None,
           ("placement.runtime=ray", "rollout.backend=vllm", "placement.nodes=1", "placement.gpus_per_node=1",
            *(f"placement.{r}={_GPU1_EVERY}" for r in ("actor", "critic", "ref", "reward")),
            "placement.vllm={engines: 1, tensor_parallel_size: 1, gpu_memory_utilization: 0.3}",
            "placement.colocate=[[actor, critic, ref, reward, vllm]]", f"train.micro_batch_size={DSCHAT_PER_DEVICE_BATCH}"),
           needs=("vllm",), about="Ray: every role and one vLLM engine (CUDA graphs) on the one GPU"),
    System("hpcrlhf-local-vllm", "hpcrlhf", None,
           ("placement.runtime=local", "rollout.backend=vllm", "engine.zero_stage=0", "rollout.vllm_kv_cache_gb=8",
            f"train.micro_batch_size={DSCHAT_PER_DEVICE_BATCH}"),
           needs=("vllm",), about="one process: every role and a vLLM engine (8 GiB KV cache, CUDA graphs), ZeRO-0"),
    hpcrlhf_local(),
    dschat_style(1, zero_stage=0),
    trl_grpo(),
    hpcrlhf_local(grpo=True),
)

SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("cpu", "recorded CPU comparison: tiny llama, 32-token prompts and answers, 64 prompts per step",
          "cpu", 2, 4, prompt_tokens=32, response_tokens=32, prompts_per_step=64, warmup_steps=1, steps=4,
          systems=_CPU_SYSTEMS + (_CPU_SCALING, _CPU_STALE), dschat_ranks=2),
    Suite("cpu-small", "compute-bound CPU comparison: a 20M llama built from config, 64-token prompts, 128 fixed new "
          "tokens, 32 prompts per step", "cpu", 2, 4, prompt_tokens=64, response_tokens=128, prompts_per_step=32,
          warmup_steps=1, steps=2, systems=_CPU_SYSTEMS, model="builtin:llama-20m", dschat_ranks=2,
          extra=("placement.gpu_memory_gb=8.0",)),  # declared GPUs: the colocated roles' activations need > 4 GiB
    Suite("cpu-tiny", "harness check (CI): the cpu suite's systems on 16-token answers, 2 measured steps",
          "cpu", 2, 4, prompt_tokens=16, response_tokens=16, prompts_per_step=32, warmup_steps=1, steps=2,
          systems=_CPU_SYSTEMS, dschat_ranks=2),
    # 4 warm-up steps: k = 4 launches steps 1-4 at step 0, so only later steps show its steady state
    Suite("cpu-longtail", "long-tail lengths on CPU: tiny llama, 32-token prompts, responses of log-normal lengths "
          "(median 32 of at most 256 tokens), 32 prompts x 4 samples per step, one vLLM engine", "cpu", 1, 1,
          prompt_tokens=32, response_tokens=256, prompts_per_step=128, warmup_steps=4, steps=6,
          systems=longtail_systems(1), lengths=LengthDist(), dschat_ranks=1),
    # the engine's decode step emulated at 20 ms (slept: the two cores stay the trainer's), as a larger model's on a
    # GPU: generation is then most of the synchronous step, as with long generations, and asynchrony can pay here
    Suite("cpu-longtail-emulated", "cpu-longtail with every engine step at least 20 ms (rollout.min_engine_step_s, "
          "slept: a larger model's decode emulated without taking the trainer's cores)", "cpu", 1, 1, prompt_tokens=32,
          response_tokens=256, prompts_per_step=128, warmup_steps=4, steps=6, systems=longtail_systems(1, 0.02),
          lengths=LengthDist(), dschat_ranks=1),
    Suite("cpu-longtail-tiny", "harness check of cpu-longtail: 8 prompts x 4 samples, at most 64 tokens, 2 measured "
          "steps", "cpu", 1, 1, prompt_tokens=16, response_tokens=64, prompts_per_step=32, warmup_steps=1, steps=2,
          systems=longtail_systems(1, names=(*_SHORT_LIST, "k2-arrival-keep")), lengths=LengthDist(), dschat_ranks=1),
    Suite("gpu-7b", "7B actor/critic/ref/RM on 2 x 8 GPUs (OpenRLHF's published 7B layout)", nodes=2, gpus_per_node=8,
          systems=_gpu_systems("ppo-7b", 2, 8, (8, 2)), **_GPU),
    Suite("gpu-13b", "13B on 4 x 8 GPUs", nodes=4, gpus_per_node=8, systems=_gpu_systems("ppo-13b", 4, 8, (8, 4)), **_GPU),
    Suite("gpu-70b", "70B on 4 x 8 GPUs (ZeRO-3, Adam in CPU memory)", nodes=4, gpus_per_node=8,
          systems=_gpu_systems("ppo-70b", 4, 8, (4, 8), ("--zero-stage=3", "--offload-optimizer", "--use-vllm")),
          **_GPU),
    Suite("gpu-1-longtail", "one GPU, long-tail lengths: a 0.5B llama built from config, 256-token prompts, "
          "responses of log-normal lengths (median 64 of at most 512 tokens), 64 prompts x 4 samples per step",
          "gpu", 1, 1, prompt_tokens=256, response_tokens=512, prompts_per_step=256, warmup_steps=1, steps=3,
          systems=longtail_systems(16, names=_SHORT_LIST), model="builtin:llama-500m",
          lengths=LengthDist()),
    # generation a larger share of the step: the longest of 1024 tokens sets the synchronous step's generation
    Suite("gpu-1-longtail-1k", "one GPU, a longer tail: gpu-1-longtail with responses of at most 1024 tokens "
          "(median 128)", "gpu", 1, 1, prompt_tokens=256, response_tokens=1024, prompts_per_step=256, warmup_steps=1,
          steps=3, systems=longtail_systems(16, names=_SHORT_LIST),
          model="builtin:llama-500m", lengths=LengthDist()),
    Suite("gpu-1", "one GPU: a 0.5B llama built from config, 256-token prompts and answers, 64 prompts per step",
          "gpu", 1, 1, prompt_tokens=256, response_tokens=256, prompts_per_step=64, warmup_steps=1, steps=3,
          systems=_GPU1_SYSTEMS, model="builtin:llama-500m"),
)}


def get_suite(name: str) -> Suite:
    if name not in SUITES:
        raise ConfigError(f"--suite: unknown suite '{name}'; suites: {', '.join(SUITES)}")
    return SUITES[name]
