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


class Lots:
    """An engine loop's batch whose prompts finish in `lots` (lists of indices into the whole batch)."""

    def __init__(self, generations, lots) -> None:
        self.generations, self.lots, self.launched = generations, lots, time.monotonic()

    def as_finished(self):
        for lot in self.lots:
            time.sleep(0.05)
            yield [(i, self.generations[i]) for i in lot]

    def result(self):
        return self.generations

    def finished(self):
        return time.monotonic()


class LotEngine(LengthEngine):
    """Rank 0's prompts 1 and 0, then rank 1's 1 with rank 0's 2, then rank 1's 0 (of 3 + 2 prompts)."""

    def launch(self, prompts, params: SamplingParams) -> Lots:
        return Lots(self.generate(prompts, params), [[1, 0], [4, 2], [3]])


def _lot_rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        shared = Rank0Rollout(LotEngine() if rank == 0 else None,
                              SimpleNamespace(rank=rank, world_size=2, is_main=rank == 0), streaming=True)
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1, lengths=LENGTHS[rank])
        batch = shared.launch(PROMPTS[rank], params)
        lots = [[(i, [(g.prompt_ids, len(g.response_ids)) for g in gens]) for i, gens in lot]
                for lot in batch.as_finished()]
        whole = [[(g.prompt_ids, len(g.response_ids)) for g in gens] for gens in batch.result()]
        out[rank] = (lots, whole, batch.finished() is not None)
    finally:
        dist.destroy_process_group()


def test_each_rank_takes_its_groups_as_rank_0s_loop_finishes_them():
    """`Rank0Batch.as_finished`: each rank gets its own prompts' groups (indices in its share) in the lots rank 0's
    loop finishes them in -- a rank with none in a lot waits for the next --, each once; `result()` after is the
    whole share, in prompt order."""
    got = two_ranks(_lot_rank)
    want = {rank: [[(p, n)] * 2 for p, n in zip(PROMPTS[rank], LENGTHS[rank])] for rank in (0, 1)}
    assert [[i for i, _ in lot] for lot in got[0][0]] == [[1, 0], [2]]
    assert [[i for i, _ in lot] for lot in got[1][0]] == [[1], [0]]
    for rank in (0, 1):
        lots, whole, finished = got[rank]
        assert whole == want[rank] and finished, (rank, whole)
        assert all(group == want[rank][i] for lot in lots for i, group in lot), (rank, lots)


def _stopping_rank(rank: int, port: int, out: dict) -> None:
    import hpcrlhf.engines.rollout.shared as shared_module
    from hpcrlhf.run.signals import StopRequested

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        seen: list = []
        if rank == 0:  # asked to stop once it took its first lot
            shared_module.stop_requested_here = lambda: len(seen) >= 1
        shared = Rank0Rollout(LotEngine() if rank == 0 else None,
                              SimpleNamespace(rank=rank, world_size=2, is_main=rank == 0), streaming=True)
        batch = shared.launch(PROMPTS[rank], SamplingParams(n=1, temperature=1.0, max_new_tokens=8, seed=1,
                                                            lengths=LENGTHS[rank]))
        try:
            for lot in batch.as_finished():
                seen.append(sorted(i for i, _ in lot))
            out[rank] = ("walked", seen)
        except StopRequested:
            out[rank] = ("stopped", seen)
    finally:
        dist.destroy_process_group()


def test_a_stop_on_rank_0_ends_every_ranks_walk_of_the_lots():
    """Rank 0 asked to stop after its first lot: it sends no more, and every rank -- rank 1 had none of its groups
    yet -- raises StopRequested at the same lot (none is left waiting for a lot that never comes)."""
    got = two_ranks(_stopping_rank)
    assert got == {0: ("stopped", [[0, 1]]), 1: ("stopped", [])}, got


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
