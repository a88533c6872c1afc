"""The simulated asynchronous schedule (hpcrlhf.bench.schedule) against closed forms: with fixed lengths it
is the step-time model's synchronous and overlapped step; on hand-made lengths a synchronous step is the
longest response's decode plus the trainer's and the sync's seconds; the length distribution's median and
capped share are the log-normal's."""

import math
import random
import statistics

import pytest

from hpcrlhf.bench.schedule import LengthDist, paper_schedules, schedule_table, simulate_schedule
from hpcrlhf.bench.stepmodel import (A800_80GB, LLAMA2_KV_BYTES, LLAMA2_PARAMS, PAPER_LAYOUTS, Efficiency, Hardware,
                                     SystemShape, Workload, overlapped_step, predict)

LAYOUT = PAPER_LAYOUTS["7b"]["distributed"]  # 4 engines of TP 1


def workload(response: int = 1024, samples: int = 1024) -> Workload:
    return Workload(LLAMA2_PARAMS["7b"], LLAMA2_PARAMS["7b"], 1024, response, samples, LLAMA2_KV_BYTES["7b"])


@pytest.mark.parametrize("response", [256, 4096])
def test_fixed_lengths_reproduce_the_synchronous_and_the_overlapped_step(response):
    """Every response C tokens, each engine running its whole share at once: k = 0 is `predict`'s step
    (generate + make_experience + train + sync, one after the other), k = 1 and 2 its overlapped step
    max(generate, make_experience + train) + sync -- generation-bound at 4096 tokens, train-bound at 256."""
    w = workload(response)
    phases = predict(w, LAYOUT, A800_80GB, Efficiency())
    share = w.samples // LAYOUT.engines
    run = {k: simulate_schedule(w, LAYOUT, A800_80GB, Efficiency(), LengthDist("fixed"), k=k, steps=8,
                                max_num_seqs=share) for k in (0, 1, 2)}
    assert run[0].step_s == pytest.approx(phases["step"], rel=1e-9)
    assert run[1].step_s == pytest.approx(overlapped_step(phases), rel=1e-9)
    assert run[2].step_s == pytest.approx(overlapped_step(phases), rel=1e-9)
    assert run[0].occupancy == pytest.approx(phases["generate"] / run[0].step_s, rel=1e-6)  # full rows while decoding


def test_a_synchronous_step_waits_for_the_longest_response_by_hand():
    """One engine, two samples per batch of 3 and 10 tokens, no prompt, no KV: a decode step costs the
    weights' read d = 2P / (HBM x decode_bw) whatever the rows, so a synchronous step is 10 d (the longest
    response) + the trainer's seconds for 13 tokens + the sync; one step ahead hides the decode."""
    hw = Hardware("slow-memory", peak_flops=1e18, hbm_bytes_per_s=1e9, link_bytes_per_s=1e9)
    w = Workload(params=1e9, critic_params=1e9, prompt=0, response=10, samples=2)
    lay = SystemShape("distributed", devices=5, actor=1, critic=1, ref=1, reward=1, engines=1, tp=1)
    eff = Efficiency()
    phases = predict(w, lay, hw, eff)
    d = 2e9 / (1e9 * eff.decode_bw)
    trainer = (phases["make_experience"] + phases["train"]) * 13 / 20  # predict's seconds are for 2 x 10 tokens
    batches = [[3, 10]] * 6
    sync = simulate_schedule(w, lay, hw, eff, batches, k=0, steps=6)
    assert sync.step_s == pytest.approx(10 * d + trainer + phases["weight_sync"], rel=1e-9)
    assert sync.occupancy == pytest.approx((3 + 10) * d / (2 * sync.step_s), rel=1e-6)  # rows x seconds / (2 x step)
    ahead = simulate_schedule(w, lay, hw, eff, batches, k=1, steps=6)
    assert ahead.step_s == pytest.approx(max(10 * d, trainer) + phases["weight_sync"], rel=1e-9)


def test_lognormal_lengths_have_the_stated_median_and_share_at_the_cap():
    """median C x median_frac; P(L = C) = P(Z > ln(1 / median_frac) / sigma) (1.88 % for the default)."""
    cap, dist = 4096, LengthDist()
    drawn = dist.draw(cap, 40000, random.Random(3))
    assert statistics.median(drawn) == pytest.approx(cap * 0.125, rel=0.03)
    at_cap = sum(n == cap for n in drawn) / len(drawn)
    assert at_cap == pytest.approx(0.5 * math.erfc(math.log(8) / math.sqrt(2)), abs=0.003)
    assert min(drawn) >= 1 and max(drawn) == cap
    assert dist.draw(cap, 3, random.Random(0)) == dist.draw(cap, 3, random.Random(0))
    assert LengthDist.parse("lognormal:0.25,0.5") == LengthDist("lognormal", 0.25, 0.5)
    assert LengthDist.parse("fixed").draw(7, 2, random.Random(0)) == [7, 7]
    with pytest.raises(ValueError, match="lognormal:MEDIAN_FRAC,SIGMA"):
        LengthDist.parse("lognormal:0.25")


def test_under_a_long_tail_partial_rollouts_keep_the_engines_full_and_pay_off():
    """7B, 8192-token limit, long-tail lengths: one step ahead hides generation partly; partial rollouts
    with k = 2 (stragglers continue in the background) are faster still and keep the engines fuller;
    every schedule reads the same lengths (one seed), and every share is a share."""
    rows = {(r["k"], r["partial"], r["order"]): r for r in schedule_table(workload(8192), LAYOUT, A800_80GB,
                                                                          Efficiency(), LengthDist(), steps=12)
            if r["stale"] == "drop"}
    assert rows[0, False, "plan"]["speedup_vs_sync"] == 1
    assert rows[1, False, "plan"]["speedup_vs_sync"] > 1.3
    assert rows[2, True, "plan"]["step_s"] < 0.85 * rows[2, False, "plan"]["step_s"]
    assert rows[2, True, "plan"]["occupancy"] > rows[0, False, "plan"]["occupancy"]
    for (k, _, order), r in rows.items():
        assert 0 < r["occupancy"] <= 1 and 0 < r["engine_busy_share"] <= 1 and 0 <= r["trainer_idle_share"] < 1
        assert r["max_age"] <= k and (r["dropped"] == 0 or order == "arrival")  # nothing trained older than k


def test_arrival_order_equals_plan_order_without_a_tail_and_drops_what_outlives_k():
    """Fixed lengths: every sample of a batch ends together, so arrival order takes exactly plan order's batches
    (the same steps to 1e-9, nothing dropped). Under the long tail at 8192 tokens, where a decode step reads every
    running row's KV cache (the model keeps them all: no preemption), a long response takes longer than two steps
    to generate: without partial rollouts each sync drains the engines, so every sample ends within its step and
    arrival order, taking the first that end, is no slower than plan order; with them a long response runs on
    across syncs, outlives k = 2 and is dropped and started again, over and over -- the rule holds (nothing
    trained older than k) but the restarts cost more than the ordering wins; k = 4 drops fewer."""
    w = workload(1024)
    for k, partial in ((1, False), (2, True)):
        runs = {o: simulate_schedule(w, LAYOUT, A800_80GB, Efficiency(), LengthDist("fixed"), k=k, partial=partial,
                                     steps=8, max_num_seqs=256, order=o) for o in ("plan", "arrival")}
        assert runs["arrival"].step_s == pytest.approx(runs["plan"].step_s, rel=1e-9)
        assert runs["arrival"].dropped == 0 and runs["arrival"].max_age == runs["plan"].max_age == k
    tail = {(k, p, o): simulate_schedule(workload(8192), LAYOUT, A800_80GB, Efficiency(), LengthDist(), k=k, partial=p,
                                         steps=12, order=o)
            for k, p, o in ((2, False, "plan"), (2, False, "arrival"), (2, True, "plan"), (2, True, "arrival"),
                            (4, True, "arrival"))}
    assert tail[2, False, "arrival"].step_s <= tail[2, False, "plan"].step_s and tail[2, False, "arrival"].dropped == 0
    assert tail[2, True, "arrival"].dropped > 12 * 1024 * 0.05  # the drop storm
    assert tail[2, True, "arrival"].step_s > tail[2, True, "plan"].step_s
    assert 0 < tail[4, True, "arrival"].dropped < tail[2, True, "arrival"].dropped
    assert all(r.max_age <= r.k for r in tail.values())
    # keeping stale samples (rollout.stale_groups keep) ends the storm: nothing started again, faster than dropping,
    # at the price of samples older than k
    kept = simulate_schedule(workload(8192), LAYOUT, A800_80GB, Efficiency(), LengthDist(), k=2, partial=True,
                             steps=12, order="arrival", stale="keep")
    assert kept.dropped == 0 and kept.step_s < tail[2, True, "arrival"].step_s and kept.max_age > 2
    with pytest.raises(ValueError, match="arrival with k >= 1"):
        simulate_schedule(w, LAYOUT, A800_80GB, Efficiency(), LengthDist(), k=0, order="arrival")
    with pytest.raises(ValueError, match="stale must be drop, or keep in arrival order; got 'keep' in plan order"):
        simulate_schedule(w, LAYOUT, A800_80GB, Efficiency(), LengthDist(), k=1, stale="keep")


def test_only_separate_engines_have_an_asynchronous_schedule_and_lengths_are_checked():
    with pytest.raises(ValueError, match="colocated layout has no asynchronous schedule"):
        simulate_schedule(workload(), PAPER_LAYOUTS["7b"]["colocated"], A800_80GB, Efficiency(), LengthDist(), k=1)
    with pytest.raises(ValueError, match="give 4 batches of 2 lengths in"):
        simulate_schedule(workload(16, 2), LAYOUT, A800_80GB, Efficiency(), [[1, 17]] * 4, k=0, steps=4)


def test_paper_schedules_cover_every_shipped_size_at_both_limits():
    out = paper_schedules()
    assert set(out["shapes"]) == {f"{s}-{c}" for s in ("7b", "13b", "70b") for c in (1024, 8192)}
    for rows in out["shapes"].values():
        assert [(r["k"], r["partial"], r["order"]) for r in rows][:4] == [(k, False, "plan") for k in (0, 1, 2, 4)]
        assert all(r["speedup_vs_sync"] > 0.99 for r in rows)  # never slower than waiting for every response
