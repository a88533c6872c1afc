"""One rollout engine shared by every training rank of a machine (the local runtime with the vLLM
backend and several ranks): rank 0 holds the engine, the ranks' prompts are gathered to it and
the generations scattered back. On Ray each engine is its own actor instead (hpcrlhf.cluster.engines)."""

from __future__ import annotations

from collections.abc import Sequence

from hpcrlhf.engines.rollout.contract import ENGINE_MEMORY, Generation, SamplingParams


class Rank0Rollout:
    """One rollout engine on rank 0 generating for every training rank of this machine: prompts
    are gathered to rank 0 and the generations scattered back."""

    def __init__(self, engine, env):
        self.engine, self.env = engine, env

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        import torch.distributed as dist

        gathered: list = [None] * self.env.world_size
        dist.all_gather_object(gathered, [list(p) for p in prompts])
        parts: list = [None]
        if self.env.is_main:
            flat = [p for part in gathered for p in part]
            out = self.engine.generate(flat, params)
            bounds = [0]
            for part in gathered:
                bounds.append(bounds[-1] + len(part))
            parts = [[out[a:b] for a, b in zip(bounds, bounds[1:])]]
        dist.broadcast_object_list(parts, src=0)
        return parts[0][self.env.rank]

    def load_weights(self, tensors):
        if self.env.is_main:
            return self.engine.load_weights(tensors)
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
