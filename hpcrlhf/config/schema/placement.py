"""Where each role of a ppo job runs on a cluster allocation: the settings the node map is built
from (`hpcrlhf.placement`, `hpcrlhf plan`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hpcrlhf.config.schema.checks import require, require_finite

PlacementRole = Literal["actor", "critic", "ref", "reward", "vllm", "reward_server"]


PLACEMENT_ROLES: tuple[str, ...] = ("actor", "critic", "ref", "reward", "vllm", "reward_server")
"""Roles a node map places, in placement order (vLLM engines, then the job's reward servers last)."""
MODEL_ROLES: tuple[str, ...] = ("actor", "critic", "ref", "reward")
"""The roles DeepSpeed runs (each a group of ranks): the ones a colocation group is placed by."""


@dataclass(frozen=True)
class RoleConfig:
    """GPUs of one model role in the node map, and its DeepSpeed settings where they differ from
    the job's `engine` section."""

    nodes: int = 1
    """Nodes the role spans; it takes `gpus_per_node` GPUs on each (0: the role gets no GPUs)."""
    gpus_per_node: int = 1
    """GPUs the role takes on each of its nodes; its data-parallel ranks are nodes x gpus_per_node
    (0: the role gets no GPUs)."""
    zero_stage: Literal[0, 1, 2, 3] | None = None
    """This role's ZeRO stage (null: engine.zero_stage)."""
    offload_optimizer: bool | None = None
    """Keep this role's optimizer states in CPU memory (null: engine.offload_optimizer). Trained
    roles (actor, critic) only."""
    offload_params: bool | None = None
    """Keep this role's weights in CPU memory between uses, ZeRO-3 only (null: actor and critic
    engine.offload_params, ref reference.offload, reward false)."""
    sleep: bool = False
    """Trained roles (actor, critic) with vLLM engines: while the engines generate, move this
    role's DeepSpeed states (weights, gradients, optimizer) to CPU memory and back for scoring and
    training (DeepSpeed offload_states), so engines colocated with it can use that memory
    (`hpcrlhf plan` shows the memory of each phase). On GPUs only: on CPU the states are in CPU
    memory already and this is a no-op. Not with offload_params (those weights never are on the GPU)."""

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class VLLMPlacementConfig:
    engines: int = 0
    """vLLM engines generating rollouts (rollout.backend=vllm needs at least one; hf none)."""
    tensor_parallel_size: int = 1
    """GPUs per engine, all on one node (tensor parallelism needs the fast links inside a node)."""
    gpu_memory_utilization: float = 0.9
    """Share of each of its GPUs' memory an engine claims for weights and KV cache. Colocated with
    trained roles it must leave them room (e.g. 0.3-0.5)."""
    max_restarts: int = 0
    """Engines that die mid-run (their node still up) restarted within the job, in all: the new
    engine starts on the same GPUs, takes the actor's current weights and redoes its share of the
    step, so no sample is lost or changed. 0, or once used up: the run ends as a lost worker (exit
    4) and a requeued job resumes from the last checkpoint."""
    weight_sync: Literal["collective", "object_store"] = "collective"
    """How the actor's weights reach the engines after each update (Ray runtime). collective: one
    process group of actor rank 0 and every engine worker (NCCL on GPUs, gloo on CPU), the
    weights streamed in buckets out of the actor's (ZeRO-3: gathered chunk by chunk) and loaded
    layer by layer as they arrive. object_store: the whole state dict gathered on actor rank 0,
    put in Ray's object store and loaded by each engine from there (the fallback)."""
    sync_bucket_mb: int = 256
    """Collective weight sync: the most megabytes broadcast at once (bigger tensors go alone)."""
    sleep: bool = False
    """Between rollouts the engines release their GPU memory (vLLM sleep mode, level 1: weights to
    CPU memory, KV cache dropped) for the roles colocated with them to score and train in; they wake
    for the weight sync (weights first, the KV cache once the trained roles sleep again, see
    placement.<role>.sleep). Needs a platform with vLLM sleep mode (CUDA, ROCm, XPU): on CPU a
    no-op. Not with rollout.max_staleness 1 (the engines then generate while the roles train)."""

    def __post_init__(self) -> None:
        require_finite(self, "placement.vllm")
        require(self.sync_bucket_mb >= 1, "placement.vllm.sync_bucket_mb", self.sync_bucket_mb,
                "use at least 1 (megabytes per broadcast)")
        require(self.max_restarts >= 0, "placement.vllm.max_restarts", self.max_restarts,
                "use 0 (a dead engine ends the run) or more restarts")
        require(self.engines >= 0, "placement.vllm.engines", self.engines, "use 0 (no vLLM) or more engines")
        require(self.tensor_parallel_size >= 1, "placement.vllm.tensor_parallel_size", self.tensor_parallel_size,
                "use at least 1 GPU per engine")
        require(0 < self.gpu_memory_utilization <= 1, "placement.vllm.gpu_memory_utilization",
                self.gpu_memory_utilization, "use a share in (0, 1], e.g. 0.9 alone on its GPUs")


@dataclass(frozen=True)
class RewardServerConfig:
    """The reward servers a ppo job on Ray starts for its sources with `reward.sources[i].servers`."""

    cpus: int = 1
    """Ray CPUs reserved for each rule's server (its built-in rules check answers in as many
    processes: `rules.workers`). A reward model's server takes one GPU instead."""
    start_timeout_s: float = 600.0
    """The longest every server may take to load, listen and answer a first request, in seconds;
    past it the job stops before its first step, naming the server, its node and its log."""

    def __post_init__(self) -> None:
        require_finite(self, "placement.reward_server")
        require(self.cpus >= 1, "placement.reward_server.cpus", self.cpus, "use at least 1 CPU per rule server")
        require(self.start_timeout_s > 0, "placement.reward_server.start_timeout_s", self.start_timeout_s,
                "give a positive number of seconds, e.g. 600")


@dataclass(frozen=True)
class PlacementConfig:
    """Where each role of a PPO job runs on the allocation (nodes x GPUs), for the Ray runtime.
    `hpcrlhf plan RECIPE` prints the resulting node map and rejects layouts that cannot work.
    The defaults fit one GPU: actor, critic and reference share it (reward models and vLLM
    engines join it once given GPUs)."""

    nodes: int = 1
    """Nodes of the allocation the job asks for (`hpcrlhf plan --nodes` overrides)."""
    gpus_per_node: int = 1
    """GPUs per node of the allocation (`hpcrlhf plan --gpus-per-node` overrides)."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB, for the memory check."""
    cpus_per_node: int | None = None
    """CPU cores of each node of the allocation (`hpcrlhf plan --cpus-per-node` overrides); null: checked
    only against the allocation's own once it is known (`hpcrlhf sbatch/submit --cpus-per-gpu`, and the job
    at its start). The node map counts the cores the job's CPU work claims on each node -- its rule
    servers' (placement.reward_server.cpus each) and the agent environments' threads (agent.env_workers per
    vLLM engine, on the engine's node) -- and fails when a node's claims exceed them. `hpcrlhf sbatch` asks
    Slurm for --cpus-per-gpu = ceil(cpus_per_node / gpus_per_node) unless given."""
    actor: RoleConfig = field(default_factory=RoleConfig)
    """The trained policy."""
    critic: RoleConfig = field(default_factory=RoleConfig)
    """The value model (ppo.advantage_estimator gae; give it no GPUs otherwise)."""
    ref: RoleConfig = field(default_factory=RoleConfig)
    """The frozen reference model (ppo.init_kl_coef or kl_loss_coef > 0; no GPUs otherwise)."""
    reward: RoleConfig = field(default_factory=lambda: RoleConfig(gpus_per_node=0))
    """Every reward model of reward.sources, together (no GPUs when all sources are rules)."""
    vllm: VLLMPlacementConfig = field(default_factory=VLLMPlacementConfig)
    """The vLLM rollout engines."""
    reward_server: RewardServerConfig = field(default_factory=RewardServerConfig)
    """The reward servers the job starts (`reward.sources[i].servers`)."""
    colocate: tuple[tuple[PlacementRole, ...], ...] = (("actor", "critic", "ref", "reward", "vllm", "reward_server"),)
    """Groups of roles that share the same GPUs, e.g. [[actor, ref], [critic, reward]]. Roles in a
    group need the same nodes and gpus_per_node (vLLM: engines x tensor_parallel_size equal to
    the group's GPUs); a role with no GPUs in a group places nothing. Other roles get GPUs of
    their own. reward_server (the reward models' servers, `reward.sources[i].servers`) shares the
    GPUs of its group's first role with GPUs, server k on its k-th GPU (wrapping around)."""
    allow_idle_gpus: bool = False
    """Accept an allocation with GPUs no role uses (otherwise the plan is rejected)."""
    simulated_gpus: bool = False
    """Let the local Ray cluster (runtime ray without RAY_ADDRESS) declare GPUs this host does not
    have, e.g. 2 nodes x 4 GPUs on a CPU-only machine: every role then runs on CPU, which suits tiny
    models only (the ppo-tiny-ray recipes test layouts so). Off, a map this host's GPUs cannot hold
    fails before anything starts. A Ray cluster at RAY_ADDRESS is checked against its own GPUs."""
    runtime: Literal["local", "ray"] = "local"
    """local: every role inside the training process (or each torchrun rank); the layout above is
    only planned. ray: every role on its own Ray workers, placed as the node map says, on the
    Ray cluster at RAY_ADDRESS, else on a local one of `nodes` x `gpus_per_node` started for the
    job (GPUs declared, nodes on loopback addresses)."""
    local_network: Literal["auto", "private", "host"] = "auto"
    """The network of a local Ray cluster (runtime ray without RAY_ADDRESS), whose servers listen on
    every interface: private -- the job moves into its own network namespace before Ray starts, so
    nothing of it is reachable from other hosts (nor can it reach them: models and data must be
    local or cached); auto -- private where the kernel allows unprivileged user namespaces, else the
    host's network with a warning; host -- the host's network, guarded by the cluster's token only
    (for runs that must download). A Slurm job's cluster is the allocation's, token-guarded."""

    def __post_init__(self) -> None:
        require_finite(self, "placement")
        require(self.nodes >= 1, "placement.nodes", self.nodes, "use at least 1 node")
        require(self.gpus_per_node >= 1, "placement.gpus_per_node", self.gpus_per_node, "use at least 1 GPU")
        require(self.gpu_memory_gb > 0, "placement.gpu_memory_gb", self.gpu_memory_gb,
                "give the memory of one GPU in GiB, e.g. 80")
        require(self.cpus_per_node is None or self.cpus_per_node >= 1, "placement.cpus_per_node", self.cpus_per_node,
                "give the CPU cores of one node, e.g. 64, or null")
        for name in ("actor", "critic", "ref", "reward"):
            self._check_role(name, getattr(self, name))
        seen: dict[str, int] = {}
        for i, group in enumerate(self.colocate):
            key = f"placement.colocate[{i}]"
            unknown = [r for r in group if r not in PLACEMENT_ROLES]
            require(not unknown, key, list(group), f"roles are {', '.join(PLACEMENT_ROLES)}")
            require(len(set(group)) == len(group) >= 2, key, list(group),
                    "a group names two or more different roles, e.g. [actor, ref]")
            for role in group:
                require(role not in seen, key, list(group),
                        f"{role} is already in placement.colocate[{seen.get(role)}]; a role shares GPUs with "
                        f"one group only: merge the two groups")
                seen[role] = i
            require("reward_server" not in group or any(r in MODEL_ROLES for r in group), key, list(group),
                    "reward servers share the GPUs of a model role's group: add one (e.g. [critic, reward_server]), "
                    "or leave reward_server out to give its servers GPUs of their own")

    @staticmethod
    def _check_role(name: str, role: RoleConfig) -> None:
        key = f"placement.{name}"
        require(role.nodes >= 0, f"{key}.nodes", role.nodes, "use 0 (no GPUs) or more nodes")
        require(role.gpus_per_node >= 0, f"{key}.gpus_per_node", role.gpus_per_node, "use 0 (no GPUs) or more")
        require(role.zero_stage in (None, 0, 1, 2, 3), f"{key}.zero_stage", role.zero_stage, "use 0-3, or null")
        if name in ("ref", "reward"):
            require(role.offload_optimizer is None, f"{key}.offload_optimizer", role.offload_optimizer,
                    f"{name} is frozen and has no optimizer: leave it null")
        if role.zero_stage is not None:
            require(not (role.offload_optimizer and role.zero_stage == 0), f"{key}.offload_optimizer", True,
                    f"optimizer offload needs ZeRO: set {key}.zero_stage to 1, 2 or 3")
            require(not (role.offload_params and role.zero_stage != 3), f"{key}.offload_params", True,
                    f"parameter offload needs parameter sharding: set {key}.zero_stage=3")
