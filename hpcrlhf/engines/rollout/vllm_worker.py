"""What hpcrlhf adds to vLLM's worker class, in vLLM's own worker processes
(`LLM(worker_extension_cls=EXTENSION_CLASS)`): joining a weight-sync group, loading the weights
broadcast in it, repacking the CPU build's expert weights after such a reload, and a floor on the
duration of each model step (a benchmark's emulation of a larger model). vLLM imports
this module in each worker by the class's path; only method *names* cross its process boundary
(`collective_rpc`)."""

from __future__ import annotations

import gc
import time

import torch

from hpcrlhf.engines import weight_sync


class WeightSyncExtension:
    """Mixed into vLLM's worker class (`LLM(worker_extension_cls=...)`), in the worker process.

    Only the method's *name* crosses the process boundary in `collective_rpc`, so no pickled
    callables (and no VLLM_ALLOW_INSECURE_SERIALIZATION) are involved."""

    def hpcrlhf_reader_spins(self) -> list[float]:
        """How long each shared-memory queue reader of this worker busy-waits after a read
        (`hpcrlhf.engines.vllm_plugin`)."""
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        def reader(o) -> bool:
            try:
                return isinstance(o, SpinCondition) and o.is_reader
            except ReferenceError:  # a weak proxy whose object is gone
                return False

        return [o.busy_loop_s for o in gc.get_objects() if reader(o)]

    def hpcrlhf_min_step_s(self, seconds: float) -> float:
        """Make each model step of this worker (`execute_model` with tokens scheduled) last at least
        `seconds` -- it sleeps the rest, holding no core -- as a larger model's step would (0: off).
        In the worker, not the caller: vLLM's engine core runs ahead of its caller and queues each
        step's outputs, so a caller that slows only its own reads falls behind that queue (outputs
        of samples it paused since arrive after seconds of stale ones). Returns the floor set."""
        if not hasattr(self, "hpcrlhf_step_floor"):
            unslowed = self.execute_model  # type: ignore[attr-defined]

            def execute_model(scheduler_output, *args, **kwargs):
                began = time.perf_counter()
                out = unslowed(scheduler_output, *args, **kwargs)
                if self.hpcrlhf_step_floor and scheduler_output.total_num_scheduled_tokens:
                    time.sleep(max(0.0, began + self.hpcrlhf_step_floor - time.perf_counter()))
                return out

            self.execute_model = execute_model
        self.hpcrlhf_step_floor = float(seconds)
        return self.hpcrlhf_step_floor

    def hpcrlhf_join_weight_group(self, spec: dict, first_rank: int) -> int:
        """Join a weight-sync group (`hpcrlhf.engines.weight_sync`) as rank `first_rank` + this
        worker's rank in its engine. A worker may be in two groups: its engine's own (`load_weights`)
        and a trainer's; joining a group of the same kind replaces the one joined before."""
        spec = weight_sync.SyncGroup(**spec)
        rank = first_rank + self.rank  # type: ignore[attr-defined]
        if not hasattr(self, "hpcrlhf_weight_groups"):
            self.hpcrlhf_weight_groups = {}
        self.hpcrlhf_weight_groups[spec.kind] = weight_sync.join(spec, rank)
        return rank

    def hpcrlhf_receive_weights(self, kind: str) -> tuple[int, float]:
        """Load the weights rank 0 of the group of `kind` is broadcasting, layer by layer as they
        arrive (vLLM's in-place reload: checkpoint names, fused layers, TP shards, CPU repacking).
        Returns how many tensors arrived and the seconds from the first one to the end (a worker
        may wait for the sender long before that: an engine armed while the actor trains)."""
        count, first = 0, None

        def counted():
            nonlocal count, first
            for item in weight_sync.receive(self.hpcrlhf_weight_groups[kind]):
                first = first or time.perf_counter()
                count += 1
                yield item

        stream = counted()
        self.reload_weights(weights_iterator=stream)  # type: ignore[attr-defined]
        for _ in stream:  # whatever the loader left unread: on to the last bucket, or the group hangs
            pass
        repack_cpu_experts(self.model_runner.get_model())  # type: ignore[attr-defined]
        return count, time.perf_counter() - (first or time.perf_counter())


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Redo the CPU grouped-GEMM packing of mixture-of-experts weights after an in-place reload.

    vLLM 0.32 packs a CPU MoE layer's expert weights (`cpu_prepack_moe_weight`) only when the
    layer is first set up; on a weight update (`_setup_kernel` with a kernel already built) it
    copies the new weights in *unpacked* and skips that step, so the kernel reads the raw
    layout as packed: the same weights reloaded give log-probs off by ~0.1 (measured on
    tiny-mixtral). Here each such layer's weights are packed in place, as the first setup does.
    Layers of other backends (GPU, zentorch) and other vLLM versions are left alone. Returns
    the number of layers repacked."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    repacked = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name)
            with torch.no_grad():
                weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        repacked += 1
    return repacked


EXTENSION_CLASS = f"{__name__}.{WeightSyncExtension.__name__}"
"""The class vLLM mixes into its worker, by path (`LLM(worker_extension_cls=...)`)."""
