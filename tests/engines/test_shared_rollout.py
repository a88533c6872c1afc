"""`Rank0Rollout` (several local ranks, one engine on rank 0): every rank's prompts generated as one batch
on rank 0 and each rank given its own back -- each prompt with its own length (`SamplingParams.lengths`,
rollout.length_key) carried along, whatever the ranks' shares -- at once (`generate`) or launched on rank 0's
engine loop and taken later (`launch`, `Rank0Batch`). Two gloo ranks, a scripted engine."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import torch.distributed as dist
import torch.multiprocessing as mp

from hpcrlhf.engines.rollout import Generation, SamplingParams
from hpcrlhf.engines.rollout.contract import Done
from hpcrlhf.engines.rollout.shared import Rank0Rollout

PROMPTS = {0: [[1, 2], [3], [4, 5, 6]], 1: [[7], [8, 9]]}
LENGTHS = {0: (5, 1, 3), 1: (4, 2)}


class LengthEngine:
    """Answers each prompt with `lengths[i]` tokens (its first token repeated), once per sample."""

    def __init__(self) -> None:
        self.batches: list[tuple[list, SamplingParams]] = []

    def generate(self, prompts, params: SamplingParams) -> list[list[Generation]]:
        self.batches.append((prompts, params))
        return [[Generation(list(p), [p[0]] * params.lengths[i], [-0.5] * params.lengths[i], True)
                 for _ in range(params.n)] for i, p in enumerate(prompts)]

    def launch(self, prompts, params: SamplingParams) -> Done:  # an engine loop's batch, here done at once
        return Done(self.generate(prompts, params))


def _rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        engine = LengthEngine() if rank == 0 else None
        shared = Rank0Rollout(engine, SimpleNamespace(rank=rank, world_size=2, is_main=rank == 0), streaming=True)
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1, lengths=LENGTHS[rank])
        gens = shared.generate(PROMPTS[rank], params)
        first, second = shared.launch(PROMPTS[rank], params), shared.launch(PROMPTS[rank][:1], params.part(0, 1))
        assert second.finished() is None  # taken in launch order, as the trainer does
        launched = [first.result(), second.result(), list(first.as_finished())]
        out[rank] = ([[(g.prompt_ids, len(g.response_ids)) for g in group] for group in gens],
                     engine and [(prompts, p.lengths) for prompts, p in engine.batches],
                     [[[(g.prompt_ids, len(g.response_ids)) for g in group] for group in r] for r in launched[:2]],
                     [i for i, _ in launched[2][0]] if len(launched[2]) == 1 else None)
    finally:
        dist.destroy_process_group()


def test_each_ranks_prompts_come_back_with_their_own_lengths():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, out), nprocs=2)
        got = dict(out)
    for rank in (0, 1):
        mine, _, (first, second), groups = got[rank]
        want = [[(p, n)] * 2 for p, n in zip(PROMPTS[rank], LENGTHS[rank])]
        assert mine == want and first == want and second == want[:1], (rank, mine, first, second)
        assert groups == list(range(len(PROMPTS[rank])))  # the whole batch at once, each prompt once
    # one batch per call on rank 0: rank 0's prompts, then rank 1's, each with its length
    assert got[0][1] == [(PROMPTS[0] + PROMPTS[1], LENGTHS[0] + LENGTHS[1])] * 2 + [
        ([PROMPTS[0][0], PROMPTS[1][0]], (LENGTHS[0][0], LENGTHS[1][0]))]
