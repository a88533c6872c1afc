"""One rollout engine shared by every training rank of a machine (the local runtime with the vLLM
backend and several ranks): rank 0 holds the engine, the ranks' prompts are gathered to it and
the generations scattered back. On Ray each engine is its own actor instead (hpcrlhf.cluster.engines)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpcrlhf.engines.rollout.contract import ENGINE_MEMORY, Generation, SamplingParams


class Rank0Rollout:
    """One rollout engine on rank 0 generating for every training rank of this machine: prompts
    are gathered to rank 0 and the generations scattered back."""

    def __init__(self, engine, env):
        self.engine, self.env = engine, env

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        return self._on_rank0([list(p) for p in prompts], lambda flat: (self.engine.generate(flat, params), None))[0]

    def run_episodes(self, runner, rows: Sequence[Mapping[str, Any]], params: SamplingParams, env_seed: int,
                     origins: Sequence[str]) -> tuple[list[list[Generation]], Any]:
        """Every rank's multi-turn trajectories of `rows` run by rank 0's `runner` (`AgentRunner`:
        the environments and tools in rank 0's process) on the engine, as one batch seeded by rank 0's
        `params` and `env_seed`: (this rank's generations, the batch's figures on rank 0 and None on
        the others, so that figures added over ranks count each trajectory once)."""

        def run(flat):
            flat_rows, flat_origins = zip(*flat) if flat else ((), ())
            return runner.run(self.engine, list(flat_rows), params, env_seed, list(flat_origins))

        generations, stats = self._on_rank0(list(zip(rows, origins)), run)
        return generations, stats if self.env.is_main else None

    def _on_rank0(self, items: list, work: Callable[[list], tuple[list, Any]]) -> tuple[list, Any]:
        """Gather every rank's `items` to rank 0, which runs `work` on them all (in rank order) and
        returns (one result per item, something for every rank); scatter back: (this rank's results,
        that something)."""
        import torch.distributed as dist

        gathered: list = [None] * self.env.world_size
        dist.all_gather_object(gathered, items)
        parts: list = [None]
        if self.env.is_main:
            out, shared = work([x for part in gathered for x in part])
            bounds = [0]
            for part in gathered:
                bounds.append(bounds[-1] + len(part))
            parts = [([out[a:b] for a, b in zip(bounds, bounds[1:])], shared)]
        dist.broadcast_object_list(parts, src=0)
        results, shared = parts[0]
        return results[self.env.rank], shared

    def load_weights(self, tensors, version: int | None = None):
        if self.env.is_main:
            return self.engine.load_weights(tensors, version)
        for _ in tensors:  # the stream's gathers are collective: walk it to the end
            pass
        return None

    def sleep(self) -> None:
        if self.engine is not None:
            self.engine.sleep()

    def wake(self, tags=ENGINE_MEMORY) -> None:
        if self.engine is not None:
            self.engine.wake(tags)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
