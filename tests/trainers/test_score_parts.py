"""Scoring a rollout's groups as they are generated (`reward.overlap`): the same rollout and scores as
scoring the whole batch at once, and the scoring time split into what the step still waited for
(`timing/reward`) and what went on while generation did (`timing/reward_overlap`)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from hpcrlhf.config.schema import RewardConfig, RewardSourceConfig
from hpcrlhf.data.prompts import Prompt
from hpcrlhf.engines.rollout import Generation, SamplingParams
from hpcrlhf.run.folder import Run
from hpcrlhf.trainers.online import LaunchedRollout, OnlineTrainer

SCORE_S = 0.2
GENERATE_S = 0.3


class Tokens:
    """A tokenizer of single-letter tokens: id i is chr(97 + i)."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(97 + i) for i in seq) for seq in ids]


class SlowLength:
    """A reward set: the response's length, and a second source twice it; SCORE_S per call."""

    names = ["rule_len", "rule_twice"]

    def __init__(self):
        self.calls, self.spans = [], []

    def score(self, responses):
        began = time.monotonic()
        time.sleep(SCORE_S)
        self.calls.append(len(responses))
        self.spans.append((began, time.monotonic()))
        length = torch.tensor([float(len(r.text)) for r in responses])
        return 3 * length, {"rule_len": length, "rule_twice": 2 * length}


class Staggered:
    """A batch of 6 prompts x 2 samples whose groups finish two at a time out of prompt order,
    GENERATE_S apart (the last two GENERATE_S after the first are scored)."""

    def __init__(self, generations):
        self.generations, self.launched, self.done, self.waited = generations, time.monotonic(), None, 0.0

    def as_finished(self):
        for item in ((3, 2), (4, 5), (1, 0)):
            began = time.monotonic()
            time.sleep(GENERATE_S)
            self.waited += time.monotonic() - began
            if 0 in item:
                self.done = time.monotonic()
            yield [(i, self.generations[i]) for i in item]

    def finished(self):
        return self.done

    def result(self):
        return self.generations


def launched() -> LaunchedRollout:
    prompts = [Prompt((p,), f"p{p}", {"id": p}) for p in range(6)]
    generations = [[Generation([p], [p] * (p + j + 1), [0.0] * (p + j + 1), True) for j in range(2)] for p in range(6)]
    return LaunchedRollout(prompts, SamplingParams(n=2, max_new_tokens=16), Staggered(generations))


def trainer(overlap: bool, ranks: int = 1, zero_stage: int = 2, reward_model: bool = False):
    cfg = SimpleNamespace(reward=RewardConfig(sources=(RewardSourceConfig(rule="task"),), overlap=overlap),
                          engine=SimpleNamespace(zero_stage=zero_stage))
    rewards = SlowLength()
    rewards.has_models = reward_model
    t = SimpleNamespace(cfg=cfg, run=Run.__new__(Run), tokenizer=Tokens(), rewards=rewards,
                        env=SimpleNamespace(world_size=ranks))
    t.scores_as_finished = lambda: OnlineTrainer.scores_as_finished(t)
    return t


def test_groups_are_scored_as_they_finish_unless_a_reward_models_forwards_need_every_rank_at_once():
    """With several ranks the groups come in lots of any size per rank: a reward model under ZeRO-3 (its forwards
    gather its layers from every rank) scores the whole batch, so every rank makes the same forwards."""
    assert OnlineTrainer.scores_as_finished(trainer(True, ranks=2, zero_stage=3))  # rules alone: rank-local
    assert OnlineTrainer.scores_as_finished(trainer(True, ranks=2, zero_stage=2, reward_model=True))
    assert OnlineTrainer.scores_as_finished(trainer(True, ranks=1, zero_stage=3, reward_model=True))
    assert not OnlineTrainer.scores_as_finished(trainer(True, ranks=2, zero_stage=3, reward_model=True))
    assert not OnlineTrainer.scores_as_finished(trainer(False))


@pytest.mark.parametrize("overlap", [True, False])
def test_groups_scored_as_they_arrive_give_the_rollout_of_the_whole_batch(overlap):
    t, batch = trainer(overlap), launched()
    t.run.timings, t.run.watchdog = {}, None  # a bare Run: its timings, no watchdog
    rollout, total = OnlineTrainer._score_parts(t, batch)
    # prompt-major, a prompt's samples together, whatever order the groups came in
    assert [r.prompt for r in rollout.responses] == [f"p{p}" for p in range(6) for _ in range(2)]
    lengths = [float(p + j + 1) for p in range(6) for j in range(2)]
    assert [r.text for r in rollout.responses] == ["".join(chr(97 + p) for _ in range(n))
                                                    for p, n in zip([p for p in range(6) for _ in range(2)], map(int, lengths))]
    assert rollout.parts["rule_len"].tolist() == lengths and rollout.parts["rule_twice"].tolist() == [2 * x for x in lengths]
    assert total.tolist() == [3 * x for x in lengths]
    assert [g.response_ids for g in rollout.generations] == [[p] * (p + j + 1) for p in range(6) for j in range(2)]
    # the accounting, against the calls' own clocks: scoring before the last groups arrived is hidden
    timings, spans = t.run.timings, t.rewards.spans
    seconds = [end - began for began, end in spans]
    if overlap:  # three calls; the first two while the last groups were still being generated
        assert t.rewards.calls == [4, 4, 4] and spans[1][1] < batch.pending.done < spans[2][0]
        assert timings["timing/reward_overlap"] == pytest.approx(seconds[0] + seconds[1], abs=0.05)
        assert timings["timing/reward"] == pytest.approx(seconds[2], abs=0.05)
        assert timings["timing/generate"] == pytest.approx(batch.pending.waited, abs=0.05)  # the waits, not the scoring
    else:  # one call, after everything was generated
        assert t.rewards.calls == [12] and timings["timing/reward_overlap"] == 0.0
        assert timings["timing/reward"] == pytest.approx(seconds[0], abs=0.05)


class Rank1Walk:
    """Rank 1's side of rank 0's lots (`Rank0Rollout._send`): its groups 1, then none, then 0, then the end."""

    env = SimpleNamespace(rank=1)

    def __init__(self, generations):
        self.sent = [[(1, generations[1])], [], [(0, generations[0])], []]
        self.meetings = 0

    def _send(self, parts):
        assert parts is None  # (rank 1 sends nothing)
        self.meetings += 1
        groups = self.sent.pop(0)
        return groups, "more" if self.sent else "done"


class StoppedRule(SlowLength):
    def score(self, responses):
        from hpcrlhf.run.signals import StopRequested

        raise StopRequested


def test_a_rank_whose_rule_is_cut_short_walks_rank_0s_lots_to_the_end_before_it_stops():
    """With several ranks every lot is a meeting with rank 0: a rank whose user rule was cut short by a stop request
    does not leave (rank 0 would wait at the next lot forever) -- it walks the rest unscored, then stops."""
    from hpcrlhf.engines.rollout.shared import Rank0Batch
    from hpcrlhf.run.signals import StopRequested

    t = trainer(True, ranks=2)
    t.rewards = StoppedRule()
    t.run.timings, t.run.watchdog = {}, None
    generations = [[Generation([p], [p] * 2, [0.0] * 2, True)] for p in range(2)]
    walk = Rank1Walk(generations)
    batch = LaunchedRollout([Prompt((p,), f"p{p}", {"id": p}) for p in range(2)], SamplingParams(n=1, max_new_tokens=4),
                            Rank0Batch(None, [3, 2], walk))
    with pytest.raises(StopRequested):
        OnlineTrainer._score_parts(t, batch)
    assert walk.meetings == 4 and not walk.sent  # every lot, to rank 0's end
    one = launched()  # one rank: the stop leaves at once
    t1 = trainer(True)
    t1.rewards, t1.run.timings, t1.run.watchdog = StoppedRule(), {}, None
    with pytest.raises(StopRequested):
        OnlineTrainer._score_parts(t1, one)
    assert one.pending.done is None  # its last lot was never asked for
