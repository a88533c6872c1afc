"""vLLM engines as Ray actors, one per tensor-parallel group of the node map.

An engine actor runs on its group's node and sees exactly the group's GPUs; vLLM starts its TP
workers itself with multiprocessing (never Ray: that would escape the map, and vLLM's CPU build
does not support it). Weights arrive as a full state dict after every actor update.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

from hpcrlhf.cluster.worker_group import RoleWorker, WorkerGroup, even_bounds, gather


def omp_binding(tp: int, cpus: int) -> str:
    """vLLM CPU's per-TP-rank core sets, "0-3|4-7"; ranks share cores when there are fewer than tp."""
    per = cpus // tp
    if per <= 1:
        return "|".join(str(i % cpus) for i in range(tp))
    return "|".join(f"{i * per}-{(i + 1) * per - 1}" for i in range(tp))


class EngineWorker(RoleWorker):
    """A VLLMRollout on one TP group: `generate`, `load_weights`, `close`."""

    def __init__(self, role: str, rank: int, world_size: int, model_dir: str, *, tensor_parallel_size: int,
                 seed: int = 0, **engine_kwargs: Any) -> None:
        super().__init__(role, rank, world_size)
        from hpcrlhf.engines.rollout import VLLMRollout

        if tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            import torch

            if not torch.cuda.is_available():  # CPU build: one OpenMP core set per TP rank
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_binding(tensor_parallel_size, os.cpu_count() or 1)
        self.engine = VLLMRollout(model_dir, seed=seed + rank, tensor_parallel_size=tensor_parallel_size,
                                  distributed_executor_backend="mp", **engine_kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], params) -> list:
        return self.engine.generate(prompts, params)

    def load_weights(self, state: Mapping[str, Any]) -> None:
        self.engine.load_weights(state)

    def close(self) -> None:
        self.engine.close()


class EngineFleet:
    """The engine actors as one rollout engine: a batch of prompts is split into contiguous
    parts, one per engine, generated concurrently and joined in order. Each part's sampling
    seeds follow its prompts' positions in the whole batch, so the samples do not depend on how
    many engines there are."""

    def __init__(self, group: WorkerGroup) -> None:
        self.group = group

    @property
    def handles(self) -> list[Any]:
        return list(self.group.workers)

    def generate(self, prompts: Sequence[Sequence[int]], params) -> list:
        refs = [w.generate.remote(prompts[a:b], dataclasses.replace(params, first_index=params.first_index + a))
                for w, (a, b) in zip(self.group.workers, even_bounds(len(prompts), len(self.group))) if b > a]
        return [g for part in gather(refs) for g in part]

    def close(self) -> None:
        import ray

        if self.group.workers:
            try:
                gather(self.group.call_async("close"))
            except ray.exceptions.RayActorError:
                pass  # an engine died (the error being raised says so); kill the others
            self.group.kill()
