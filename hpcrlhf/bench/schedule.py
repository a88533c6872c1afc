"""The asynchronous schedule of PPO under long-tail response lengths, simulated: how long a step takes
when the engines generate up to k steps ahead (`rollout.max_staleness`), with and without partial
rollouts (`rollout.partial`), for a layout whose engines run on devices of their own (`distributed`).

The phases' costs are the step-time model's (`stepmodel.predict`, the same hardware, efficiencies and
workload); what this adds is time: responses of different lengths (`LengthDist`), engines that batch
continuously, and the rules of the schedule (docs/design/streaming-staleness.md, 3.2-3.5):

- step s (0-based) trains batch s with weights of version s and publishes version s + 1; batch b is
  queued on the engines once they hold version max(0, b - k) ("plan" order: every sample of batch s is
  generated exactly min(s, k) versions behind);
- an engine runs at most `max_num_seqs` requests at once and admits queued ones as others finish; a
  decode step costs the larger of reading the weights and the running rows' KV cache and computing them
  (`predict`'s decode term, with each row's own mean context) -- on real engines its cost hardly depends
  on the row count until the compute term takes over, which is why a batch whose rows end early wastes
  the engine;
- admitting requests costs their prefill (`predict`'s prefill term per prompt);
- the trainer takes batch s once all its samples are finished, makes experience and trains for
  `predict`'s seconds scaled to the batch's real token count, then publishes: the weights come from the
  actor's live weights, so the engines must take them before the next update. Without partial rollouts
  they first finish what is in flight (the drain: no request may span two versions); with them the
  running requests are paused, and continue after the weights load, their prompt + prefix prefilled
  again under the new weights. The sync itself costs `predict`'s weight_sync.

The model is fluid (a request's remaining tokens fall continuously between events), all engines take
each version at once, and batches are split evenly over the engines (sample i on engine i mod E).
With fixed lengths, k = 0 reproduces `predict`'s step and k >= 1 its `overlapped_step` (tested).

Arrival order (`rollout.stream_order: arrival`, design 3.2): the samples are handed out one at a time in the
plan's order, as many as the rule for k lets start ((version + k + 1) x samples admitted and not dropped), each
to the engine with the fewest queued and running; a sample's age is that of its first token (the version when it
was admitted); step s trains the first `samples` that ended, after dropping those older than s - k (running,
paused or ended: started again from scratch, first in line) -- or, with `stale="keep"` (rollout.stale_groups keep),
dropping none: a slow sample is trained when it ends, however old. A sample stands for a group (one sample per
prompt, as the shipped shapes count them).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from hpcrlhf.bench.stepmodel import (A800_80GB, H100_SXM, LLAMA2_KV_BYTES, LLAMA2_PARAMS, PAPER_LAYOUTS, Efficiency,
                                     Hardware, SystemShape, Workload, paper_predictions, predict)
from hpcrlhf.placement.shapes import shape_of

MAX_NUM_SEQS = 256
"""vLLM's default cap on running requests per engine (`max_num_seqs`)."""


@dataclass(frozen=True)
class LengthDist:
    """Response lengths: "lognormal" draws L = min(C, ceil(C x median_frac x exp(sigma Z))), Z standard normal,
    C the response limit (max_new_tokens); "fixed" gives every response C tokens (DSChat's benchmarks, and
    `predict`). The default (median C/8, sigma 1) has mean ~0.2 C, p99/median ~10, and ~1.9 % of responses cut
    at C: a long-tail reasoning run's shape (stated, not fitted: no published histogram gives numbers)."""

    kind: Literal["lognormal", "fixed"] = "lognormal"
    median_frac: float = 0.125
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "fixed"):
            raise ValueError(f"length distribution kind must be lognormal or fixed, got {self.kind!r}")
        if not (0 < self.median_frac <= 1 and self.sigma >= 0):
            raise ValueError(f"lognormal lengths need 0 < median_frac <= 1 and sigma >= 0, got {self.median_frac}, "
                             f"{self.sigma}")

    def draw(self, cap: int, n: int, rng: random.Random) -> list[int]:
        if self.kind == "fixed":
            return [cap] * n
        return [min(cap, max(1, math.ceil(cap * self.median_frac * math.exp(self.sigma * rng.gauss(0.0, 1.0)))))
                for _ in range(n)]

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """"fixed", "lognormal" or "lognormal:MEDIAN_FRAC,SIGMA"."""
        kind, _, args = text.partition(":")
        if kind == "fixed" and not args:
            return cls("fixed")
        if kind == "lognormal":
            if not args:
                return cls()
            try:
                median, sigma = (float(x) for x in args.split(","))
            except ValueError:
                raise ValueError(f"lengths {text!r}: write lognormal:MEDIAN_FRAC,SIGMA, e.g. lognormal:0.125,1.0") from None
            return cls("lognormal", median, sigma)
        raise ValueError(f"lengths {text!r}: use fixed, lognormal or lognormal:MEDIAN_FRAC,SIGMA")


@dataclass
class _Request:
    batch: int
    length: int
    left: float
    """Tokens still to decode when it was last queued."""
    kv: float
    """KV-cache bytes this row reads per decode step (its mean context)."""
    index: int = 0
    """Its place in its batch (arrival order: the hand-out order)."""
    head: int | None = None
    """The version its first token was generated with (None: not started)."""


@dataclass
class _Engine:
    """One engine: its queue, and its running requests as a heap by the decode count at which each ends
    (every running row decodes one token per step, so the next to end is the heap's first)."""

    queue: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    decoded: float = 0.0
    """Decode steps done so far (fluid)."""
    kv: float = 0.0
    """KV bytes the running rows read per decode step."""
    blocked_until: float = 0.0
    """A prefill under way: no decoding before then."""
    rows_time: float = 0.0
    """Integral of running rows over time (occupancy)."""
    busy_time: float = 0.0


@dataclass(frozen=True)
class Schedule:
    """One simulated schedule: `k`, `partial`, the steady-state step (median seconds between updates after
    the first k + 2), the trained and generated tokens per second per device, the engines' occupancy (mean
    running rows over their share of a batch, capped at max_num_seqs), the share of time they decode or
    prefill, and the trainer's idle share."""

    k: int
    partial: bool
    step_s: float
    trained_tokens_per_s_per_gpu: float
    generated_tokens_per_s_per_gpu: float
    occupancy: float
    engine_busy_share: float
    trainer_idle_share: float
    steps: int
    order: str = "plan"
    dropped: int = 0
    """(arrival) Samples dropped as too old and started again."""
    max_age: int = 0
    """The oldest trained sample's age in updates (at most k, but with `stale` keep)."""
    stale: str = "drop"
    """(arrival) What became of a sample grown older than k: drop (started again) or keep (trained when it ends)."""


def simulate_schedule(w: Workload, lay: SystemShape, hw: Hardware, eff: Efficiency,
                      lengths: LengthDist | Sequence[Sequence[int]], *, k: int, partial: bool = False, steps: int = 20,
                      seed: int = 0, max_num_seqs: int = MAX_NUM_SEQS,
                      order: Literal["plan", "arrival"] = "plan", stale: Literal["drop", "keep"] = "drop") -> Schedule:
    """Simulate `steps` PPO steps of workload `w` (w.response: the response limit C) on layout `lay`
    (`distributed`: engines on devices of their own), k steps ahead, with or without partial rollouts, in plan
    or arrival order. `lengths`: a distribution, drawn from `seed` (the same lengths for every schedule), or each
    batch's w.samples lengths (`steps` of them). `stale`: arrival order's rollout.stale_groups."""
    if lay.kind != "distributed":
        raise ValueError(f"a {lay.kind} layout has no asynchronous schedule: its engines and roles take turns")
    if k < 0 or steps < k + 3:
        raise ValueError(f"need k >= 0 and steps >= k + 3 (a steady state), got k={k}, steps={steps}")
    if order not in ("plan", "arrival") or (order == "arrival" and k < 1):
        raise ValueError(f"order must be plan, or arrival with k >= 1; got {order!r} with k={k}")
    if stale not in ("drop", "keep") or (stale == "keep" and order != "arrival"):
        raise ValueError(f"stale must be drop, or keep in arrival order; got {stale!r} in {order} order")
    phases = predict(w, lay, hw, eff)
    per_token_train = (phases["make_experience"] + phases["train"]) / (w.samples * (w.prompt + w.response))
    fwd_flops = lay.tp * hw.peak_flops * eff.forward_mfu
    decode_bytes = lay.tp * hw.hbm_bytes_per_s * eff.decode_bw

    def decode_step(e: _Engine) -> float:
        return max((2 * w.params + e.kv) / decode_bytes, 2 * w.params * len(e.running) / fwd_flops)

    if isinstance(lengths, LengthDist):
        rng = random.Random(seed)
        batches = [lengths.draw(w.response, w.samples, rng) for _ in range(steps)]
    else:
        batches = [list(b) for b in lengths]
        if len(batches) != steps or any(len(b) != w.samples or not all(1 <= n <= w.response for n in b) for b in batches):
            raise ValueError(f"lengths: give {steps} batches of {w.samples} lengths in [1, {w.response}] each")
    left_in_batch = [w.samples] * steps
    engines = [_Engine() for _ in range(lay.engines)]
    now, version, queued, admitting, pushed = 0.0, 0, 0, True, 0  # the clock, the weights, batches queued
    trainer_step, train_end, sync_end, waiting_sync = 0, None, None, False
    update_ends, trainer_busy, step_tokens, step_generated = [], 0.0, [], []
    # arrival order: hand-outs in plan order, dropped samples first (in plan order), ended ones in end order
    handed, admitted, rejected, dropped, max_age = 0, 0, 0, 0, 0
    requeued: list[_Request] = []
    ended: deque = deque()
    oldest: dict[int, int] = {}
    """Each batch's oldest first token's version."""

    def fresh(b: int, i: int) -> _Request:
        length = batches[b][i]
        return _Request(b, length, float(length), w.kv_bytes_per_token * (w.prompt + length / 2), i)

    def queue_batches() -> None:
        nonlocal queued, handed, admitted
        if order == "arrival":  # as many as the rule for k lets start, each to the least loaded engine
            room = (version + k + 1) * w.samples - (admitted - rejected)
            while room > 0 and (requeued or handed < steps * w.samples):
                if requeued:
                    request = requeued.pop(0)
                else:
                    request, handed = fresh(*divmod(handed, w.samples)), handed + 1
                min(engines, key=lambda e: len(e.queue) + len(e.running)).queue.append((request, w.prompt))
                admitted, room = admitted + 1, room - 1
            return
        while queued < steps and version >= queued - k:
            b = queued
            for i in range(len(batches[b])):
                engines[i % len(engines)].queue.append((fresh(b, i), w.prompt))
            queued += 1

    def admit(e: _Engine) -> None:
        nonlocal pushed
        tokens = 0.0
        while admitting and e.queue and len(e.running) < max_num_seqs:
            request, context = e.queue.popleft()
            if request.head is None:
                request.head = version
                oldest[request.batch] = min(oldest.get(request.batch, version), version)
            pushed += 1
            heapq.heappush(e.running, (e.decoded + request.left, pushed, request))
            e.kv += request.kv
            tokens += context
        if tokens:
            e.blocked_until = max(e.blocked_until, now) + 2 * w.params * tokens / fwd_flops

    def drop_stale() -> None:
        """(arrival) Drop what step `trainer_step` could no longer train (first token older than step - k):
        each starts again from scratch, first in line."""
        nonlocal rejected, dropped, ended

        def stale(r: _Request) -> bool:
            return r.head is not None and r.head < trainer_step - k

        gone = [r for r in ended if stale(r)]
        ended = deque(r for r in ended if not stale(r))
        for e in engines:
            gone += [r for _, _, r in e.running if stale(r)] + [r for r, _ in e.queue if stale(r)]
            e.running = [item for item in e.running if not stale(item[2])]
            heapq.heapify(e.running)
            e.kv = sum(r.kv for _, _, r in e.running)
            e.queue = deque(item for item in e.queue if not stale(item[0]))
        rejected, dropped = rejected + len(gone), dropped + len(gone)
        requeued.extend(fresh(r.batch, r.index) for r in gone)
        requeued.sort(key=lambda r: (r.batch, r.index))

    def next_finish(e: _Engine) -> float:
        if not e.running:
            return math.inf
        return max(e.blocked_until, now) + max(0.0, e.running[0][0] - e.decoded) * decode_step(e)

    def advance(e: _Engine, until: float) -> None:
        e.rows_time += len(e.running) * (until - now)
        if e.running or e.blocked_until > now:
            e.busy_time += until - now
        start = max(e.blocked_until, now)
        if until > start and e.running:
            e.decoded += (until - start) / decode_step(e)

    def pause(e: _Engine) -> None:
        """Partial rollouts: the running requests go back to the front of the queue, each to continue from
        its prefix (prefilled again with the prompt when it is admitted)."""
        kept = []
        for finish_at, _, r in sorted(e.running):
            left = max(0.0, finish_at - e.decoded)
            kept.append((replace(r, left=left), w.prompt + (r.length - left)))
        e.running, e.kv = [], 0.0
        e.queue.extendleft(reversed(kept))

    def start_training(lengths: list[int]) -> None:
        nonlocal train_end, trainer_busy
        seconds = per_token_train * sum(w.prompt + n for n in lengths)
        train_end, trainer_busy = now + seconds, trainer_busy + seconds
        step_tokens.append(sum(w.prompt + n for n in lengths))
        step_generated.append(sum(lengths))

    queue_batches()
    for e in engines:
        admit(e)
    while trainer_step < steps:
        events = [(next_finish(e), "finish") for e in engines]
        events += [(train_end, "trained")] if train_end is not None else []
        events += [(sync_end, "synced")] if sync_end is not None else []
        when, what = min(events, key=lambda x: x[0])
        if math.isinf(when):
            raise RuntimeError("the simulated schedule stalled (nothing running, nothing due): a bug in the model")
        for e in engines:
            advance(e, when)
        now = when
        if what == "trained":
            update_ends.append(when)
            train_end, admitting, waiting_sync = None, False, True
            if partial:
                for e in engines:
                    pause(e)
        elif what == "synced":
            sync_end, admitting = None, True
            version += 1
            trainer_step += 1
            if order == "arrival" and stale == "drop":
                drop_stale()
            queue_batches()
        for e in engines:  # the requests that ended now, and what takes their places
            while e.running and e.running[0][0] - e.decoded <= 1e-6:
                _, _, r = heapq.heappop(e.running)
                e.kv -= r.kv
                left_in_batch[r.batch] -= 1
                if order == "arrival":
                    ended.append(r)
            admit(e)
        if waiting_sync and all(not e.running for e in engines):  # drained (or paused): the weights go in
            sync_end, waiting_sync = when + phases["weight_sync"], False
        if train_end is None and sync_end is None and not waiting_sync and trainer_step < steps:
            if order == "plan" and left_in_batch[trainer_step] == 0:
                start_training(batches[trainer_step])
                max_age = max(max_age, trainer_step - oldest[trainer_step])
            elif order == "arrival" and len(ended) >= w.samples:  # the first that ended
                taken = [ended.popleft() for _ in range(w.samples)]
                max_age = max(max_age, *(trainer_step - r.head for r in taken))
                start_training([r.length for r in taken])
    warm = k + 2
    step_s = statistics.median(b - a for a, b in zip(update_ends[warm - 1:], update_ends[warm:]))
    share = min(max_num_seqs, math.ceil(w.samples / lay.engines))
    return Schedule(k, partial, step_s, statistics.mean(step_tokens[warm:]) / step_s / lay.devices,
                    statistics.mean(step_generated[warm:]) / step_s / lay.devices,
                    sum(e.rows_time for e in engines) / (share * now * len(engines)),
                    sum(e.busy_time for e in engines) / (now * len(engines)), 1 - trainer_busy / now, steps,
                    order, dropped, max_age, stale)


SCHEDULES = ((0, False, "plan", "drop"), (1, False, "plan", "drop"), (2, False, "plan", "drop"),
             (4, False, "plan", "drop"), (1, True, "plan", "drop"), (2, True, "plan", "drop"), (4, True, "plan", "drop"),
             (2, False, "arrival", "drop"), (2, True, "arrival", "drop"), (4, True, "arrival", "drop"),
             (2, True, "arrival", "keep"))
"""The schedules `schedule_table` compares, (k, partial, order, stale): synchronous, k = 1, 2, 4 without and with
partial rollouts in plan order, arrival order at k = 2 without and with partial rollouts and at k = 4 with them,
and k = 2 with partial rollouts keeping stale samples (rollout.stale_groups keep)."""


def schedule_name(row: dict) -> str:
    """A `schedule_table` row's schedule in words: synchronous, k=2 + partial, k=2 + partial, arrival, ..."""
    if row["k"] == 0:
        return "synchronous"
    return (f"k={row['k']}" + (" + partial" if row["partial"] else "") + (", arrival" if row["order"] == "arrival" else "")
            + (", keep" if row.get("stale") == "keep" else ""))


def schedule_table(w: Workload, lay: SystemShape, hw: Hardware, eff: Efficiency, lengths: LengthDist, *,
                   steps: int = 20, seed: int = 0) -> list[dict]:
    """Each of SCHEDULES simulated on the same lengths, with its speed-up over the synchronous one."""
    rows = [simulate_schedule(w, lay, hw, eff, lengths, k=k, partial=p, steps=steps, seed=seed, order=o, stale=st)
            for k, p, o, st in SCHEDULES]
    base = rows[0].step_s
    return [{**vars(r), "speedup_vs_sync": base / r.step_s} for r in rows]


LONG_COT = 8192
"""The response limit of the long-chain-of-thought shape `paper_schedules` adds (DAPO's runs allow 20k)."""


def paper_schedules(hw: Hardware = A800_80GB, lengths: LengthDist = LengthDist()) -> dict:
    """`schedule_table` for each shipped distributed layout (`PAPER_LAYOUTS`, efficiencies fitted on the published
    DSChat runs as `paper_predictions`), 1024 prompts x (1024 + C) tokens with C = 1024 and LONG_COT, under
    `lengths`; for step-model.json."""
    eff = Efficiency(**paper_predictions(hw)["efficiency"])
    out = {"lengths": vars(lengths), "max_num_seqs": MAX_NUM_SEQS, "shapes": {}}
    for size, layouts in PAPER_LAYOUTS.items():
        for response in (1024, LONG_COT):
            w = Workload(LLAMA2_PARAMS[size], LLAMA2_PARAMS[size], 1024, response, 1024, LLAMA2_KV_BYTES[size])
            out["shapes"][f"{size}-{response}"] = schedule_table(w, layouts["distributed"], hw, eff, lengths)
    return out


HARDWARE = {"a800": A800_80GB, "h100": H100_SXM}
"""`hpcrlhf plan --hardware` choices."""


def plan_shape(cfg, node_map) -> tuple[Workload, SystemShape]:
    """The workload and layout of a PPO job's node map with vLLM engines (`hpcrlhf plan`): the actor's and
    critic's (else the reward model's) parameters, data.max_length prompt tokens, rollout.max_new_tokens, the
    step's samples, the actor's KV bytes per token; `colocated` when a role shares the engines' GPUs."""
    engine_gpus = {d for e in node_map.engines for d in e}
    shared = any(d in engine_gpus for ranks in node_map.ranks.values() for d in ranks)
    actor = node_map.roles["actor"]
    value = node_map.roles.get("critic") or node_map.roles.get("reward")
    shape = shape_of(cfg.model.path)
    w = Workload(float(actor.params), float(value.params if value else 0), cfg.data.max_length,
                 cfg.rollout.max_new_tokens, cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
                 2.0 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2,
                 recompute=cfg.engine.gradient_checkpointing)
    count = {role: len(node_map.ranks.get(role, ())) for role in ("actor", "critic", "ref", "reward")}
    lay = SystemShape("colocated" if shared else "distributed", len(node_map.devices), **count,
                      engines=len(node_map.engines), tp=node_map.vllm.tensor_parallel_size)
    return w, lay


def plan_schedules(cfg, node_map, hw: Hardware, lengths: LengthDist) -> dict:
    """`schedule_table` for a job's node map (`plan_shape`), efficiencies fitted on the published DSChat runs;
    for a colocated layout, why there is none."""
    out = {"hardware": hw.name, "lengths": vars(lengths), "prompt_tokens": cfg.data.max_length,
           "max_new_tokens": cfg.rollout.max_new_tokens,
           "samples": cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt}
    if node_map.vllm is None:
        return {**out, "layout": None, "rows": [], "why_none": "rollout.backend is hf: the actor generates itself, so "
                "generation and training take turns whatever rollout.max_staleness (rollout.backend=vllm overlaps them)"}
    w, lay = plan_shape(cfg, node_map)
    if lay.kind != "distributed":
        return {**out, "layout": lay.kind, "rows": [], "why_none": "the engines share the roles' GPUs: generation and "
                "training take turns, so nothing overlaps whatever rollout.max_staleness"}
    out["layout"] = lay.kind
    eff = Efficiency(**paper_predictions(hw)["efficiency"])
    return {**out, "rows": schedule_table(w, lay, hw, eff, lengths), "published": PUBLISHED_ASYNC}


def render_schedules(doc: dict) -> str:
    """`plan_schedules` as the text `hpcrlhf plan --schedule` prints."""
    dist = doc["lengths"]
    told = (f"log-normal lengths, median {dist['median_frac']:g} x the limit, sigma {dist['sigma']:g}"
            if dist["kind"] == "lognormal" else "every response at the limit")
    lines = [f"asynchronous schedule (step-time model, {doc['hardware']}; {doc['samples']} samples of <= "
             f"{doc['prompt_tokens']} prompt + {doc['max_new_tokens']} response tokens, {told}):"]
    if not doc["rows"]:
        return "\n".join(lines + [f"  none: {doc['why_none']}"]) + "\n"
    lines.append(f"  {'schedule':<30}{'step s':>9}{'tokens/s/GPU':>14}{'occupancy':>11}{'trainer idle':>14}"
                 f"{'dropped':>9}{'speed-up':>10}")
    for r in doc["rows"]:
        lines.append(f"  {schedule_name(r):<30}{_seconds(r['step_s']):>9}{r['trained_tokens_per_s_per_gpu']:>14.1f}"
                     f"{r['occupancy']:>11.2f}{r['trainer_idle_share']:>14.2f}{r['dropped']:>9}{r['speedup_vs_sync']:>9.2f}x")
    lines.append("  (rollout.max_staleness = k; partial: rollout.partial; arrival: rollout.stream_order=arrival, dropped:")
    lines.append("  samples started again over the run because their first token grew older than k -- responses whose")
    lines.append("  generation takes longer than k steps; keep: rollout.stale_groups=keep, nothing dropped, a slow response")
    lines.append("  trained when it ends, however old; docs/design/streaming-staleness.md)")
    lines.append("published, other shapes (for context, not a validation):")
    lines += [f"  {name}: {figure}" for name, figure in PUBLISHED_ASYNC.items()]
    return "\n".join(lines) + "\n"


def _seconds(x: float) -> str:
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


PUBLISHED_ASYNC = {
    "verl fully async": "2.35-2.67x over colocated synchronous (Qwen2.5-Math-7B, DAPO, 28k-token responses, 32-128 GPUs)",
    "NeMo-RL one step off": "1,102 -> 1,414 tokens/s/GPU, 1.28x (Qwen3-30B-A3B, 32 H100)",
    "AReaL": "2.77x over synchronous",
    "ROLL Flash": "2.24x (RLVR), 2.72x (agentic)",
}
"""The anchors' published asynchronous speed-ups, as issue 40 gathered them from their papers and docs."""


if __name__ == "__main__":
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description="Fit the step-time model on the published DSChat runs and predict "
                                                 "the shipped layouts, synchronous and asynchronous under long-tail "
                                                 "lengths (benchmarks/results/step-model.json)")
    parser.add_argument("-o", "--output", default="benchmarks/results/step-model.json")
    doc = {**paper_predictions(), "schedules": paper_schedules()}
    Path(parser.parse_args().output).write_text(json.dumps(doc, indent=2) + "\n")
