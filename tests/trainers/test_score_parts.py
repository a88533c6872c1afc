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


def trainer(overlap: bool):
    cfg = SimpleNamespace(reward=RewardConfig(sources=(RewardSourceConfig(rule="task"),), overlap=overlap))
    return SimpleNamespace(cfg=cfg, run=Run.__new__(Run), tokenizer=Tokens(), rewards=SlowLength())


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
