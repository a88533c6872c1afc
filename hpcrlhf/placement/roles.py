"""What each role of a PPO job is, before it gets GPUs: its model(s), its effective DeepSpeed
settings (a role's own, else inherited), its memory per rank, and whether the config uses it.

Also the checks that need no layout: roles the config needs but gives no GPUs, GPUs given to
roles it never uses, batches that do not split over the ranks, and vLLM sizes the model rejects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpcrlhf.algos.estimators import CRITIC_FREE_NAMES
from hpcrlhf.config.schema import PPOConfig, RoleConfig
from hpcrlhf.placement.layout import MAX_GPUS_PER_NODE, MAX_NODES, MODEL_ROLES, shape_text
from hpcrlhf.placement.memory import (GIB, EngineMemory, MemoryParts, activation_bytes, engine_memory, frozen_memory,
                                      trained_memory)
from hpcrlhf.placement.problems import Problem
from hpcrlhf.placement.shapes import ModelShape, ShapeError, shape_of

TRAINED = ("actor", "critic")


@dataclass(frozen=True)
class RolePlan:
    """One DeepSpeed role as it will run: GPUs asked, effective settings and memory per rank."""

    name: str
    models: tuple[str, ...]
    """Model paths the role loads (the reward role: every reward model)."""
    params: int
    """Parameters it holds, summed over its models (critic and reward: as value models)."""
    nodes: int
    gpus_per_node: int
    trainable: bool
    zero_stage: int
    offload_optimizer: bool
    offload_params: bool
    memory: MemoryParts | None
    """Bytes on each of its GPUs (None when a model's shape is unknown; the plan is then rejected)."""
    sleep: bool = False
    """Its states leave the GPU while vLLM generates (placement.<role>.sleep)."""

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class EnginePlan:
    """The vLLM engines: how many, their size, and each GPU's memory and KV-cache capacity."""

    model: str
    params: int
    engines: int
    tensor_parallel_size: int
    gpu_memory_utilization: float
    memory: EngineMemory | None
    sleep: bool = False
    """The engines release their memory while the roles train (placement.vllm.sleep)."""


def sequence_tokens(cfg: PPOConfig) -> int:
    """Tokens of the longest rollout sequence: prompt (data.max_length) plus response."""
    return cfg.data.max_length + cfg.rollout.max_new_tokens


def role_models(cfg: PPOConfig) -> dict[str, list[tuple[str, str]]]:
    """Role -> (config field, model path) of each model it loads (the trainer's choices); reward: the
    reward models scored in the job, reward_server: those the job's own servers serve (one per server)."""
    served = [(f"reward.sources[{i}].model", src.model) for i, src in cfg.served_sources() if src.model]
    return {"actor": [("model.path", cfg.model.path)], "critic": [cfg.critic_source()], "ref": [cfg.reference_source()],
            "reward": cfg.in_job_reward_models(), "vllm": [("model.path", cfg.model.path)], "reward_server": served}


def uses(cfg: PPOConfig) -> dict[str, tuple[bool, str]]:
    """Role -> (whether the config needs it, the setting that decides, as text)."""
    ppo, models = cfg.ppo, role_models(cfg)["reward"]
    served = len(cfg.reward_models()) - len(models)
    by_servers = f" scored in the job ({served} served by the job's reward servers)" if served else ""
    return {
        "actor": (True, "the policy is always trained"),
        "critic": (ppo.uses_critic, f"ppo.advantage_estimator is {ppo.advantage_estimator!r}"),
        "ref": (ppo.uses_reference,
                f"ppo.init_kl_coef is {ppo.init_kl_coef} and ppo.kl_loss_coef {ppo.kl_loss_coef}"),
        "reward": (bool(models), f"reward.sources has {len(models)} reward model(s){by_servers}"),
        "vllm": (cfg.rollout.backend == "vllm", f"rollout.backend is {cfg.rollout.backend!r}"),
    }


class _Shapes:
    """Model shapes looked up once per path; a path that cannot be sized becomes a problem."""

    def __init__(self, problems: list[Problem]):
        self.problems, self.known = problems, {}

    def get(self, key: str, path: str) -> ModelShape | None:
        if path not in self.known:
            try:
                self.known[path] = shape_of(path, key)
            except ShapeError as err:
                self.known[path] = None
                self.problems.append(Problem(err.key, repr(path), err.reason, err.fix))
        return self.known[path]


def _settings(cfg: PPOConfig, name: str, role: RoleConfig) -> tuple[int, bool, bool, list[Problem]]:
    """Effective (zero_stage, offload_optimizer, offload_params): the role's own, else inherited."""
    engine, key = cfg.engine, f"placement.{name}"
    stage = engine.zero_stage if role.zero_stage is None else role.zero_stage
    inherited_params = {"ref": cfg.reference.offload, "reward": False}.get(name, engine.offload_params)
    offload_params = inherited_params if role.offload_params is None else role.offload_params
    offload_optimizer = name in TRAINED and (engine.offload_optimizer if role.offload_optimizer is None
                                             else role.offload_optimizer)
    problems = []
    if offload_optimizer and stage == 0:
        source = f"{key}.offload_optimizer" if role.offload_optimizer else "engine.offload_optimizer"
        problems.append(Problem(f"{key}.zero_stage", stage, f"optimizer offload (from {source}) needs ZeRO, but "
                                f"this role runs ZeRO-0", f"set {key}.zero_stage to 1, 2 or 3, "
                                f"or {key}.offload_optimizer=false"))
    if offload_params and stage != 3:
        problems.append(Problem(f"{key}.zero_stage", stage, "parameter offload needs parameter sharding (ZeRO-3)",
                                f"set {key}.zero_stage=3, or {key}.offload_params=false"))
    return stage, offload_optimizer, offload_params, problems


def _role_memory(cfg: PPOConfig, name: str, shapes: list[ModelShape], ranks: int, stage: int,
                 offload_optimizer: bool, offload_params: bool) -> tuple[int, MemoryParts]:
    """(parameters, bytes per rank) of a role holding models of `shapes`."""
    value_model = name in ("critic", "reward")  # a score head instead of the lm_head
    params = sum(s.value_model_params if value_model else s.params for s in shapes)
    precision = cfg.engine.precision
    if name not in TRAINED:
        return params, frozen_memory(params, ranks=ranks, zero_stage=stage, precision=precision,
                                     offload_params=offload_params)
    acts = activation_bytes(shapes[0], tokens=sequence_tokens(cfg), micro_batch=cfg.train.micro_batch_for(ranks),
                            checkpointing=cfg.engine.gradient_checkpointing)
    return params, trained_memory(params, ranks=ranks, zero_stage=stage, precision=precision,
                                  offload_optimizer=offload_optimizer, offload_params=offload_params, activations=acts)


def resolve_roles(cfg: PPOConfig, gpu_memory: int, problems: list[Problem]) -> tuple[
        dict[str, RolePlan], EnginePlan | None, dict[str, ModelShape | None]]:
    """The roles that get GPUs and the vLLM engines (None without engines), with their memory, and
    the shape of each model the job's reward servers serve (by path; None: unknown, a problem)."""
    shapes, models, p = _Shapes(problems), role_models(cfg), cfg.placement
    roles = {}
    for name in MODEL_ROLES:
        role = getattr(p, name)
        if role.num_gpus == 0:
            continue
        found = [shapes.get(key, path) for key, path in models[name]]
        stage, offload_optimizer, offload_params, wrong = _settings(cfg, name, role)
        problems += wrong
        params, memory = 0, None
        if all(found):
            params, memory = _role_memory(cfg, name, found, role.num_gpus, stage, offload_optimizer, offload_params)
        roles[name] = RolePlan(name, tuple(path for _, path in models[name]), params, role.nodes, role.gpus_per_node,
                               name in TRAINED, stage, offload_optimizer, offload_params, memory, role.sleep)
    engine = None
    if p.vllm.engines:
        shape = shapes.get("model.path", cfg.model.path)
        memory = shape and engine_memory(shape, tensor_parallel_size=p.vllm.tensor_parallel_size,
                                         gpu_memory_utilization=p.vllm.gpu_memory_utilization,
                                         gpu_memory=gpu_memory, precision=cfg.engine.precision)
        engine = EnginePlan(cfg.model.path, shape.params if shape else 0, p.vllm.engines,
                            p.vllm.tensor_parallel_size, p.vllm.gpu_memory_utilization, memory, p.vllm.sleep)
        problems += _engine_problems(cfg, shape, engine)
    return roles, engine, {path: shapes.get(key, path) for key, path in models["reward_server"]}


# ---------------------------------------------------------------- checks without a layout
def check_roles(cfg: PPOConfig, problems: list[Problem]) -> None:
    """Roles the config needs without GPUs, and GPUs for roles it never uses."""
    p = cfg.placement
    for name, (needed, why) in uses(cfg).items():
        if name == "vllm":
            given, key, shape = p.vllm.engines, "placement.vllm.engines", p.vllm.engines
        else:
            role = getattr(p, name)
            given, key, shape = role.num_gpus, f"placement.{name}", shape_text(role.nodes, role.gpus_per_node)
        if needed and not given:
            problems.append(Problem(key, shape, f"{why}, which needs the {name} role, but it has no GPUs",
                                    _give_fix(name, cfg)))
        elif given and not needed:
            problems.append(Problem(key, shape, f"{why}, so the {name} role is never used and would waste its GPUs",
                                    _drop_fix(name, cfg)))


def _give_fix(name: str, cfg: PPOConfig) -> str:
    actor = cfg.placement.actor
    if name == "actor":
        return "set placement.actor.nodes and placement.actor.gpus_per_node to 1 or more"
    if name == "vllm":
        return ("set placement.vllm.engines (e.g. 1 engine colocated with the actor, or engines on GPUs of their "
                "own), or rollout.backend=hf to generate with the actor")
    alternative = {"critic": f"; or use a critic-free ppo.advantage_estimator ({', '.join(CRITIC_FREE_NAMES)})",
                   "ref": "; or set ppo.init_kl_coef=0 and ppo.kl_loss_coef=0 (no KL to a reference)",
                   "reward": "; or score with rules only"}.get(name, "")
    return (f"set placement.{name}.nodes and gpus_per_node (e.g. {actor.nodes} x {actor.gpus_per_node} and add "
            f"{name} to the actor's placement.colocate group){alternative}")


def _drop_fix(name: str, cfg: PPOConfig) -> str:
    if name == "vllm":
        return "set placement.vllm.engines=0, or rollout.backend=vllm to generate with the engines"
    return f"set placement.{name}.gpus_per_node=0 and give its GPUs to another role"


def check_batches(cfg: PPOConfig, roles: dict[str, RolePlan], problems: list[Problem]) -> None:
    """Mini-batches split evenly over the trained roles' ranks, and prompts over the actor's."""
    g = cfg.train.global_batch_size
    for name in TRAINED:
        if name not in roles:
            continue
        ranks = roles[name].ranks
        m = cfg.train.micro_batch_for(ranks)
        if g % (m * ranks):
            step = m * ranks
            options = sorted({max(step, g // step * step), (g // step + 1) * step})
            problems.append(Problem(
                "train.global_batch_size", g,
                f"not a multiple of train.micro_batch_size ({m}) x the {name}'s {ranks} ranks = {step}",
                f"use train.global_batch_size {' or '.join(map(str, options))} (and a matching "
                f"rollout.prompts_per_step), a micro_batch_size dividing {g // ranks if g % ranks == 0 else g}, "
                f"or a different number of {name} GPUs"))
    actor, prompts = roles.get("actor"), cfg.rollout.prompts_per_step
    if actor and prompts % actor.ranks:
        problems.append(Problem("rollout.prompts_per_step", prompts,
                                f"does not split over the actor's {actor.ranks} ranks",
                                f"use a multiple of {actor.ranks}, e.g. {_round_up(prompts, actor.ranks)}"))


def _engine_problems(cfg: PPOConfig, shape: ModelShape | None, engine: EnginePlan) -> list[Problem]:
    """vLLM sizes the model rejects, a rollout that does not split over the engines, and a KV
    cache too small for one sequence."""
    problems, tp, n = [], engine.tensor_parallel_size, engine.engines
    sequences = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    if sequences % n:
        # prompts_per_step x samples must split over the engines and into whole mini-batches
        s, g = cfg.rollout.samples_per_prompt, cfg.train.global_batch_size
        step = math.lcm(n // math.gcd(n, s), g // math.gcd(g, s))
        # engine counts that split them, up to 2n: a divisor is at most `sequences`, an engine takes a GPU
        fits = [d for d in range(1, min(2 * n, sequences, MAX_NODES * MAX_GPUS_PER_NODE) + 1) if sequences % d == 0]
        problems.append(Problem("placement.vllm.engines", n,
                                f"the {sequences} sequences of a rollout (rollout.prompts_per_step "
                                f"{cfg.rollout.prompts_per_step} x samples_per_prompt {s}) "
                                f"do not split evenly over {n} engines",
                                f"use {_either(fits)} engines, or rollout.prompts_per_step "
                                f"{_round_up(cfg.rollout.prompts_per_step, step)} (a multiple of {step})"))
    if shape is None:
        return problems
    heads, kv = shape.num_attention_heads, shape.num_kv_heads
    if not _tp_fits(tp, heads, kv):
        valid = [t for t in range(1, heads + 1) if _tp_fits(t, heads, kv)]
        problems.append(Problem("placement.vllm.tensor_parallel_size", tp,
                                f"vLLM splits attention heads over the TP ranks: {tp} must divide the {heads} "
                                f"attention heads of {engine.model!r}, and its {kv} KV heads must divide by it "
                                f"(or it by them)", f"use tensor_parallel_size {_either(valid)}"))
    memory, need = engine.memory, sequence_tokens(cfg)
    if memory is not None and memory.kv_cache_tokens < need:  # vLLM refuses to start then
        problems.append(Problem(
            "placement.vllm.gpu_memory_utilization", engine.gpu_memory_utilization,
            f"each engine GPU gets {memory.claimed / GIB:.1f} GiB, its share of the weights takes "
            f"{memory.parts.weights / GIB:.1f} GiB, leaving KV cache for {memory.kv_cache_tokens} tokens, less than "
            f"one sequence (data.max_length + rollout.max_new_tokens = {need})",
            "raise gpu_memory_utilization (colocate less with the engines), or raise tensor_parallel_size"))
    return problems


def _tp_fits(tp: int, heads: int, kv_heads: int) -> bool:
    """vLLM's rule: TP divides the attention heads; the KV heads split over TP, or are
    replicated when TP is a multiple of their number."""
    return heads % tp == 0 and (kv_heads % tp == 0 if tp <= kv_heads else tp % kv_heads == 0)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _either(values: list[int]) -> str:
    """`1, 2 or 4`."""
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"
