"""The training-engine seam over DeepSpeed.

Trainers drive a model through `TrainingEngine` (forward, backward, step, checkpoints, export)
and never import deepspeed. The DeepSpeed config is built by one pure function from hpcrlhf's
typed config, so what runs is inspectable and testable.

Loss scaling contract: the trainer passes a loss already normalised for the whole global batch
(e.g. sum of token losses on this rank x world size / tokens in the global batch). DeepSpeed's own
division by accumulation steps is switched off, and its average over data-parallel ranks turns
that into the exact global mean — so 1 rank and N ranks, packed and unpacked, train the same.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

import torch

from hpcrlhf.cache import cache_dir, cache_root
from hpcrlhf.config.schema import EngineConfig, OptimConfig
from hpcrlhf.engines.schedule import lr_multiplier
from hpcrlhf.run.files import open_in_place


def build_deepspeed_config(
    engine: EngineConfig, optim: OptimConfig, *, micro_batch_size: int, grad_accum_steps: int, world_size: int
) -> dict[str, Any]:
    """DeepSpeed's JSON config for one role's training engine."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * world_size,
        "gradient_clipping": optim.max_grad_norm,
        "steps_per_print": 10**9,  # hpcrlhf logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": optim.lr,
                "betas": list(optim.betas),
                "eps": optim.eps,
                "weight_decay": optim.weight_decay,
                # DeepSpeed's fused Adam is a JIT-compiled op; torch's is as fast for our use and
                # needs no build. With offload DeepSpeed uses its CPU Adam regardless.
                **({} if engine.offload_optimizer else {"torch_adam": True}),
            },
        },
        "zero_optimization": {"stage": engine.zero_stage},
        "bf16": {"enabled": engine.precision == "bf16"},
    }
    zero = cfg["zero_optimization"]
    if engine.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=True, stage3_param_persistence_threshold=0)
    if engine.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if engine.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return cfg


def ensure_deepspeed_comm() -> None:
    """Attach DeepSpeed's comm layer to the process group (`engines.distributed` made it).

    ZeRO-3's `zero.Init` (inside `from_pretrained`) reads the world size from deepspeed.comm,
    so this must happen before a model is loaded, not only in `deepspeed.initialize`."""
    skip_shm_comm_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())


def skip_shm_comm_build() -> None:
    """DeepSpeed JIT-compiles a shared-memory op for CPU inference all-reduce when its comm
    backend starts (~40 s, minutes on a busy node), and loads it on every start under torch's
    plain `lock` file, which a process killed meanwhile leaves behind: every later start on the
    machine then waits forever (`load_jit_op`'s story, outside hpcrlhf's guarded cache). Training
    never uses the op, so skip it. (`import deepspeed.comm.torch as m` would give torch itself:
    reach the module through sys.modules.)"""
    import deepspeed  # noqa: F401  (registers deepspeed.comm.torch)

    mod = sys.modules.get("deepspeed.comm.torch")
    if mod is not None and hasattr(mod, "build_shm_op"):
        mod.build_shm_op = lambda: None


def maybe_zero3_init_context(ds_config: dict[str, Any]):
    """Keep transformers' ZeRO-3 hook alive while a model loads, so weights are sharded at load."""
    if ds_config["zero_optimization"]["stage"] != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    ensure_deepspeed_comm()
    return HfDeepSpeedConfig(ds_config)


def forget_state_making_step(optimizer) -> int:
    """Undo the step count of the optimizer step DeepSpeed's 16-bit optimizers without ZeRO take at
    start-up with zero gradients to create the Adam state (`FP16_UnfusedOptimizer`, which bf16 at
    ZeRO-0 uses: `initialize_optimizer_states`). Left alone, the first real update is Adam's second
    -- bias corrections for t=2: 0.735 x lr instead of lr with betas (0.9, 0.95), smaller ever after
    at the start, so a bf16 ZeRO-0 run follows neither fp32 nor bf16 under ZeRO-2/3 (measured on an
    H100 and here: norms at 1.0 did not move at all in the first step). Only states that are still
    untouched (all moments zero) are reset; returns how many."""
    inner = getattr(optimizer, "optimizer", None)
    reset = 0
    for state in getattr(inner, "state", {}).values():
        step = state.get("step")
        moments = [v for k, v in state.items() if k != "step" and torch.is_tensor(v)]
        if step is not None and float(step) > 0 and moments and not any(bool(m.any()) for m in moments):
            state["step"] = torch.zeros_like(step) if torch.is_tensor(step) else 0
            reset += 1
    return reset


class TrainingEngine:
    """A model, its optimizer and schedule, trained under DeepSpeed."""

    def __init__(self, model: torch.nn.Module, ds_config: dict[str, Any], *, optim: OptimConfig, total_steps: int,
                 gradient_checkpointing: bool = False):
        ensure_deepspeed_comm()
        import deepspeed

        self.ds_config = ds_config
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        warmup = int(optim.warmup_ratio * total_steps)
        factor = partial(lr_multiplier, total_steps=total_steps, warmup_steps=warmup, kind=optim.scheduler,
                         min_ratio=optim.min_lr_ratio)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor),
        )
        forget_state_making_step(self.engine.optimizer)
        self._untracked_norm = ds_config["zero_optimization"]["stage"] == 0 and not ds_config["bf16"]["enabled"]
        self._last_norm: float | None = None
        self.asleep = False

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def zero_stage(self) -> int:
        return self.ds_config["zero_optimization"]["stage"]

    def train(self) -> None:
        self.engine.train()

    def eval(self) -> None:
        self.engine.eval()

    def __call__(self, **batch):
        # No KV cache in training forwards: transformers only honours packed-row boundaries
        # (position_ids restarts) when no cache is present.
        return self.engine(**batch, use_cache=False)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> None:
        """Call after every micro-batch; the optimizer steps at accumulation boundaries. A step
        whose gradients hold NaN/Inf is not applied (counted in `skipped_updates`)."""
        if self._untracked_norm and self.engine.is_gradient_accumulation_boundary():
            # Plain fp32 data parallel clips without keeping the norm, and would apply NaN
            # gradients to every weight; gradients are already averaged over ranks here.
            params = [p for p in self.module.parameters() if p.grad is not None]
            self._last_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params])) if params else 0.0
            overflow = not math.isfinite(self._last_norm)
            # An optimizer reporting overflow takes DeepSpeed's own skip path: no schedule step,
            # skipped_steps + 1 (the bookkeeping of its ZeRO and bf16 optimizers).
            self.engine.optimizer.overflow = overflow
            if overflow:
                for p in params:
                    p.grad.zero_()  # DeepSpeed still clips them
                with _step_disabled(self.engine.optimizer):
                    self.engine.step()
                return
        self.engine.step()

    def sleep(self) -> None:
        """Move the engine's states (weights, gradients, optimizer) to CPU memory until `wake`
        (DeepSpeed offload_states), freeing the GPU for colocated vLLM engines. A no-op where they
        are in CPU memory already (CPU runs); idempotent."""
        if not self.asleep and self.device.type != "cpu":
            self.engine.offload_states()
        self.asleep = True

    def wake(self) -> None:
        """Bring the states `sleep` moved back to the GPU; idempotent."""
        if self.asleep and self.device.type != "cpu":
            self.engine.reload_states()
        self.asleep = False

    @property
    def skipped_updates(self) -> int:
        """Optimizer steps not applied so far because their gradients held NaN/Inf."""
        return int(self.engine.skipped_steps)

    def grad_norm(self) -> float | None:
        """Global gradient norm (before clipping) of the last optimizer step."""
        if self._untracked_norm:
            return self._last_norm
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def optimizer_stats(self) -> dict[str, float | None]:
        """The learning rate and the last gradient norm, as the training log shows them."""
        return {"train/lr": self.lr(), "train/grad_norm": self.grad_norm()}

    def save_checkpoint(self, folder: Path, client_state: dict[str, Any]) -> None:
        """Model, optimizer and scheduler (sharded per rank) plus the trainer's client state."""
        # hpcrlhf writes `latest` itself, after every rank has finished (see hpcrlhf.run.checkpoint).
        self.engine.save_checkpoint(str(folder.parent), tag=folder.name, client_state=client_state, save_latest=False)

    def load_checkpoint(self, folder: Path) -> dict[str, Any]:
        _, client_state = self.engine.load_checkpoint(str(folder.parent), tag=folder.name)
        if client_state is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {folder}")
        return client_state

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Consolidated weights on rank 0 (None elsewhere); every rank must call (ZeRO-3 gathers)."""
        if self.zero_stage == 3:
            sd = self.engine._zero3_consolidated_16bit_state_dict()
            return sd if torch.distributed.get_rank() == 0 else None
        return self.module.state_dict() if torch.distributed.get_rank() == 0 else None

    def state_chunks(self, chunk_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The state dict in chunks of about `chunk_bytes` (a module's tensors never split), each
        full while the consumer holds it: under ZeRO-3 a chunk's parameters are gathered until the
        next chunk is asked for, so the whole state dict never exists at once. Every rank must walk
        every chunk (the gathers are collective); rank 0 gets the tensors, the others `{}`."""
        state = self.module.state_dict(keep_vars=True)
        rank0 = torch.distributed.get_rank() == 0
        for names in _module_chunks(state, chunk_bytes):
            params = list({id(state[n]): state[n] for n in names if hasattr(state[n], "ds_id")}.values())
            if self.zero_stage == 3 and params:
                import deepspeed

                gathered = deepspeed.zero.GatheredParameters(params)
            else:
                gathered = contextlib.nullcontext()
            with gathered:
                yield {n: state[n].detach() for n in names} if rank0 else {}

    def gathered_parameters(self):
        """Context in which every rank holds the full parameters (for generation under ZeRO-3)."""
        if self.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()))


def _module_chunks(state: dict[str, torch.Tensor], chunk_bytes: int) -> Iterator[list[str]]:
    """State-dict names in runs of about `chunk_bytes` (ZeRO-3 sizes: `ds_numel`), cut only between
    modules, so a module's tensors (e.g. fused experts that convert together) stay in one run."""
    run: list[str] = []
    size, module = 0, None
    for name, tensor in state.items():
        parent = name.rpartition(".")[0]
        if run and parent != module and size >= chunk_bytes:
            yield run
            run, size = [], 0
        run.append(name)
        module = parent
        size += getattr(tensor, "ds_numel", tensor.numel()) * tensor.element_size()
    if run:
        yield run


@contextlib.contextmanager
def _step_disabled(optimizer: torch.optim.Optimizer):
    """`optimizer.step()` does nothing inside (weights and moments untouched)."""
    optimizer.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del optimizer.step  # the class's method again


def prepare_extensions(ds_config: dict[str, Any]) -> None:
    """DeepSpeed's JIT ops (CPU Adam) build once per machine into hpcrlhf's cache; load the ones
    `ds_config` needs now, safely (see `load_jit_op`)."""
    extensions_folder()
    if "offload_optimizer" in ds_config["zero_optimization"]:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        load_jit_op(CPUAdamBuilder())


def extensions_folder() -> Path:
    """Where torch builds JIT ops: TORCH_EXTENSIONS_DIR, set to hpcrlhf's cache unless already set."""
    return Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir("torch_extensions"))))


def load_jit_op(builder):
    """Load (building at most once per machine) a DeepSpeed JIT op, immune to stale build locks.

    torch marks a build in progress with a plain `lock` file in the op's build folder and waits,
    forever, for it to disappear; a process killed while holding it (a lost node, a job cancelled
    during start-up) would hang every later run. hpcrlhf's processes therefore build under an
    `flock` — released by the kernel when its holder dies — and, holding it, know that any torch
    lock file left in hpcrlhf's own cache belongs to a dead process and remove it. Later loads in
    this process reuse the op (DeepSpeed caches loaded ops by name). The folder is the one torch
    builds into (`extensions_folder`), so the lock cleared is the lock torch would wait on."""
    import fcntl

    extensions_dir = extensions_folder()
    extensions_dir.mkdir(parents=True, exist_ok=True)
    with os.fdopen(open_in_place(extensions_dir / ".hpcrlhf-build.flock", os.O_RDWR | os.O_CREAT), "r+b") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = extensions_dir / builder.name / "lock"
        ours = extensions_dir.resolve().is_relative_to(cache_root().resolve())
        if ours and stale.exists():
            print(f"hpcrlhf: removing {stale}, left by a process killed while building {builder.name}",
                  file=sys.stderr)
            stale.unlink(missing_ok=True)
        if not any((extensions_dir / builder.name).glob("*.so")):
            print(f"hpcrlhf: building DeepSpeed's {builder.name} op into {extensions_dir} (once per machine, "
                  "about a minute)", file=sys.stderr, flush=True)
        return builder.load()


def save_hf_model(engine: TrainingEngine, write: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Gather the trained weights (every rank takes part: ZeRO-3 gathers) and let rank 0 `write`
    them (CPU tensors) in Hugging Face format."""
    state = engine.full_state_dict()
    if torch.distributed.get_rank() == 0:
        write({k: v.detach().to("cpu").contiguous() for k, v in state.items()})
    torch.distributed.barrier()


@contextlib.contextmanager
def zero3_init_paused():
    """Load a model normally (unsharded) even while a ZeRO-3 config is active, e.g. on rank 0
    for export."""
    from transformers.integrations import deepspeed as hf_ds

    ref = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref


def build_frozen_deepspeed_config(engine: EngineConfig, *, offload: bool, micro_batch_size: int,
                                  world_size: int) -> dict[str, Any] | None:
    """DeepSpeed config of a frozen model (the reference) next to a ZeRO-3 policy: parameters
    sharded too (optionally kept in CPU memory). None at ZeRO 0-2, where a frozen model is just
    replicated (it has no gradients or optimizer states to shard)."""
    if engine.zero_stage != 3:
        return None
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {"train_micro_batch_size_per_gpu": micro_batch_size, "train_batch_size": micro_batch_size * world_size,
            "zero_optimization": zero, "bf16": {"enabled": engine.precision == "bf16"}, "steps_per_print": 10**9}


class FrozenModel:
    """A model used only for forward passes (a reference or reward model), in eval mode."""

    def __init__(self, model: torch.nn.Module, ds_config: dict[str, Any] | None, device: torch.device):
        model.requires_grad_(False)
        if ds_config is None:
            self.module = model.to(device).eval()
        else:
            ensure_deepspeed_comm()
            import deepspeed

            self.module = deepspeed.initialize(model=model, config=ds_config)[0].module.eval()
        self.device = device

    @torch.no_grad()
    def __call__(self, **batch):
        return self.module(**batch, use_cache=False)
