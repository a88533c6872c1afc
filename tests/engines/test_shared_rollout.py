"""`Rank0Rollout` (several local ranks, one engine on rank 0): every rank's prompts generated as one batch
on rank 0 and each rank given its own back -- each prompt with its own length (`SamplingParams.lengths`,
rollout.length_key) carried along, whatever the ranks' shares -- at once (`generate`) or launched on rank 0's
engine loop and taken later (`launch`, `Rank0Batch`); the other ranks wait for rank 0 where their watchdog sees
them. Two gloo ranks, a scripted engine."""

from __future__ import annotations

import os
import socket
import time
from types import SimpleNamespace

import torch.distributed as dist
import torch.multiprocessing as mp

from hpcrlhf.engines.rollout import Generation, SamplingParams
from hpcrlhf.engines.rollout.contract import Done
from hpcrlhf.engines.rollout.shared import RANK0_PARTY, Rank0Rollout

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


def two_ranks(fn) -> dict:
    """What `fn(rank, port, out)` put in `out` on two spawned ranks (a minute at most)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        ranks = mp.spawn(fn, args=(port, out), nprocs=2, join=False)
        ends = time.monotonic() + 60
        while not ranks.join(timeout=1):
            if time.monotonic() > ends:
                for process in ranks.processes:
                    process.kill()
                raise AssertionError(f"the ranks did not end within 60 s; they said: {dict(out)}")
        return dict(out)


def test_each_ranks_prompts_come_back_with_their_own_lengths():
    got = two_ranks(_rank)
    for rank in (0, 1):
        mine, _, (first, second), groups = got[rank]
        want = [[(p, n)] * 2 for p, n in zip(PROMPTS[rank], LENGTHS[rank])]
        assert mine == want and first == want and second == want[:1], (rank, mine, first, second)
        assert groups == list(range(len(PROMPTS[rank])))  # the whole batch at once, each prompt once
    # one batch per call on rank 0: rank 0's prompts, then rank 1's, each with its length
    assert got[0][1] == [(PROMPTS[0] + PROMPTS[1], LENGTHS[0] + LENGTHS[1])] * 2 + [
        ([PROMPTS[0][0], PROMPTS[1][0]], (LENGTHS[0][0], LENGTHS[1][0]))]


class SlowEngine(LengthEngine):
    def generate(self, prompts, params: SamplingParams) -> list[list[Generation]]:
        time.sleep(3.0)
        return super().generate(prompts, params)


def _waiting_rank(rank: int, port: int, out: dict) -> None:
    from hpcrlhf.config.schema import WatchdogConfig
    from hpcrlhf.run.watchdog import WaitExpired, Watchdog

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        shared = Rank0Rollout(SlowEngine() if rank == 0 else None,
                              SimpleNamespace(rank=rank, world_size=2, is_main=rank == 0))
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=8, seed=1, lengths=LENGTHS[rank])
        if rank == 0:
            out[0] = [[len(g.response_ids) for g in group] for group in shared.generate(PROMPTS[0], params)]
            return
        dog = Watchdog(WatchdogConfig(first_s=0.5, grace_s=60.0)).start()
        started = time.monotonic()
        try:
            with dog.phase("generate"):
                shared.generate(PROMPTS[1], params)
            out[1] = "no expiry"
        except WaitExpired as e:
            out[1] = (str(e), time.monotonic() - started)
        finally:
            dog.stop()
        dist.broadcast_object_list([None], src=0)  # rank 0's scatter, that it left
    finally:
        dist.destroy_process_group()


def test_the_other_ranks_wait_for_rank_0_where_their_watchdog_ends_the_wait():
    """Rank 0 generates for 3 s; rank 1's generate phase has a 0.5 s deadline: its wait ends there, naming rank 0,
    as a WaitExpired the run can checkpoint on -- not in a collective only the process's exit could end."""
    got = two_ranks(_waiting_rank)
    assert got[0] == [[n] for n in LENGTHS[0]]
    message, waited = got[1]
    assert f"still waiting for {RANK0_PARTY}" in message and 0.5 <= waited < 2.5, got[1]
