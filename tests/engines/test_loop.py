"""The engine loop (issue 40): batches generated in a thread of its own that alone drives the vLLM engine,
several batches at once on it, and new weights taken with samples under way -- paused and continued under
them (`partial`), every token's log-prob that of the weights of its recorded span (recomputed by the Hugging
Face model). The loop's bookkeeping (failures, batches, greedy copies) is checked on a scripted engine."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from hpcrlhf.engines.rollout import Generation, SamplingParams
from hpcrlhf.engines.rollout.contract import token_versions
from hpcrlhf.engines.rollout.loop import EngineLoop, EngineLoopError, StreamBatch, StreamingRollout
from tests.engines.test_streaming import logprobs_under, old_and_new


def wait_until(ready, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.slow
def test_batches_sharing_the_loop_draw_what_each_draws_alone(streaming, rollout_prompts):
    """Samples are seeded one by one (as a vLLM batch seeds its children): two batches launched together
    give the tokens each gives alone; groups come as they end, each prompt once; greedy samples are one
    response copied."""
    a = SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=5)
    b = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=9, first_index=4)
    streaming.loop.pop_load()
    alone_a = streaming.generate(rollout_prompts[:4], a)
    alone_b = streaming.generate(rollout_prompts[4:8], b)
    load = streaming.loop.pop_load()  # 12 samples of up to 10 tokens, then 8 of up to 6 (a step each, and one more)
    assert 2 <= load.steps <= 20 and load.busy_s > 0 and 1 <= load.rows_per_step <= 12, load
    assert streaming.loop.pop_load().steps == 0
    batch_a, batch_b = streaming.launch(rollout_prompts[:4], a), streaming.launch(rollout_prompts[4:8], b)
    seen = [i for groups in batch_b.as_finished() for i, _ in groups]
    assert sorted(seen) == [0, 1, 2, 3] and batch_b.finished() is not None
    for alone, together in ((alone_a, batch_a.result()), (alone_b, batch_b.result())):
        assert [[g.response_ids for g in gens] for gens in together] == [[g.response_ids for g in gens]
                                                                         for gens in alone]
        assert all(g.versions == [(0, 0)] for gens in together for g in gens)
    fixed = streaming.generate(rollout_prompts[:3], SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=2,
                                                                   lengths=(2, 11, 5)))
    assert [[len(g.response_ids) for g in gens] for gens in fixed] == [[2, 2], [11, 11], [5, 5]]
    greedy = streaming.generate(rollout_prompts[:2], SamplingParams(n=3, greedy=True, max_new_tokens=5))
    assert all(len({tuple(g.response_ids) for g in gens}) == 1 and len(gens) == 3 for gens in greedy)
    assert greedy[0][0] is not greedy[0][1] and greedy[0][0].response_ids is not greedy[0][1].response_ids


def test_a_floor_on_the_engine_step_slows_each_step_and_changes_no_token(streaming, rollout_prompts):
    """rollout.min_engine_step_s: every model step of the engine's worker lasts at least the floor (it sleeps the
    rest, as a larger model's step would), so a batch of 12-token samples takes >= 12 floors; the samples are those
    drawn without it. The floor is in the worker, not the loop's reads: the engine core runs ahead of the loop and
    queues its steps' outputs, so the loop keeps pace with it -- a pause after a wait sees every token generated."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, min_new_tokens=12, seed=8)
    fast = streaming.generate(rollout_prompts[:2], params)
    streaming.loop.pop_load()
    streaming.set_min_step_s(0.05)
    try:
        began = time.perf_counter()
        slow = streaming.generate(rollout_prompts[:2], params)
        took = time.perf_counter() - began
        load = streaming.loop.pop_load()
        long = SamplingParams(n=1, temperature=1.0, max_new_tokens=200, min_new_tokens=200, seed=3)
        batch = streaming.launch(rollout_prompts[:1], long)
        time.sleep(0.5)
        (state,) = streaming.suspend([batch])  # paused and continued at once
        streaming.loop.pop_load()
        (_, _, paused), = state.under_way
        wait_until(lambda: any(len(s.tokens) >= len(paused.tokens) + 5 for s in streaming.loop.stream.samples.values()))
        after = streaming.loop.pop_load()
        streaming.cancel([batch])
    finally:
        streaming.set_min_step_s(0.0)
    assert [g.response_ids for gens in slow for g in gens] == [g.response_ids for gens in fast for g in gens]
    assert took >= 0.05 * 12 and load.busy_s >= 0.05 * 12 and 12 <= load.steps <= 30, (load, took)
    # 5 tokens of the continued sample within a few steps: no queue of the paused request's outputs to read first
    # (a floor on the loop's reads alone read ~90 of them here, the core running at its own speed meanwhile)
    assert after.steps <= 12, after


def test_a_cancelled_batch_never_ends_and_the_batches_beside_it_draw_as_alone(streaming, rollout_prompts):
    """`cancel` (arrival order's drop of a group under way): the batch's samples are aborted, it never ends, and a
    batch under way beside it draws what it draws alone; one cancelled after it ended changes nothing."""
    long = SamplingParams(n=2, temperature=1.0, max_new_tokens=200, min_new_tokens=200, seed=3)
    short = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=4)
    alone = streaming.generate(rollout_prompts[:2], short)
    doomed, kept = streaming.launch(rollout_prompts[2:4], long), streaming.launch(rollout_prompts[:2], short)
    streaming.cancel([doomed])
    together = kept.result()
    assert [[g.response_ids for g in gens] for gens in together] == [[g.response_ids for g in gens] for gens in alone]
    wait_until(lambda: streaming.loop.stream.running() == 0)  # nothing of the cancelled batch is left in the engine
    assert not doomed.done() and doomed.finished() is None and not doomed.ended()
    streaming.cancel([kept])  # already ended: nothing to abort
    assert streaming.generate(rollout_prompts[:2], short)[0][0].response_ids == alone[0][0].response_ids


class Hold:
    """Holds the engine loop at the first engine-step boundary after which `ready()` (called on the loop's thread):
    no sample goes on until `set()`. Armed when made -- before the batch it waits for is launched -- and checked
    after every step, so no state is missed whatever the host's load (a check posted from the test's thread now
    and then could come only after the batch had ended: the wait never ended)."""

    def __init__(self, loop: EngineLoop, ready) -> None:
        self.loop, self.ready = loop, ready
        self.held, self.gate = threading.Event(), threading.Event()
        self._step = loop._step
        loop._step = self._held_step

    def _held_step(self) -> None:
        self._step()
        if not self.held.is_set() and self.ready():
            self.held.set()
            self.gate.wait()

    def reached(self, gone=lambda: False, timeout_s: float = 120.0) -> Hold:
        """Wait until the loop is held; fails once `gone()` (the moment passed) or after `timeout_s`."""
        try:
            wait_until(lambda: self.held.is_set() or gone(), timeout_s)
            assert self.held.is_set(), "the loop never reached the state to hold it at"
        except AssertionError:
            self.set()  # the loop is shared by the tests that follow
            raise
        return self

    def set(self) -> None:
        """Let the loop go on (and stop checking)."""
        self.loop._step = self._step
        self.gate.set()


def behind(rollout: StreamingRollout, gate: Hold, call, *args, **kwargs):
    """`call(*args, **kwargs)` (which posts a message to the loop and waits for it) run by the loop as the next thing
    after the hold (`Hold`)."""
    with ThreadPoolExecutor(1) as caller:
        answer = caller.submit(call, *args, **kwargs)
        wait_until(lambda: not rollout.loop._inbox.empty() or answer.done())  # its message waits behind the hold
        gate.set()
        return answer.result(timeout=120)


def load_behind(rollout: StreamingRollout, gate: Hold, state, version: int):
    """`rollout.load_weights(state, version)` taken by the loop as the next thing after the hold."""
    return behind(rollout, gate, rollout.load_weights, state, version=version)


def assert_paused_and_continued(rollout: StreamingRollout, prompts, model_dir: str, new_tokens: int,
                                restore: bool) -> None:
    """`load_weights` to version 1 once each sample has 3 tokens: every sample goes on under the new weights
    (two spans), each token with its span's log-prob (the HF model's); a batch launched after is of version 1.
    `restore`: the old weights go back in at the end (a shared engine)."""
    old, new = old_and_new(model_dir, 1)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, seed=3)
    stream = rollout.loop.stream
    gate = Hold(rollout.loop, lambda: len(stream.samples) == 6
                and min(len(s.tokens) for s in stream.samples.values()) >= 3)
    batch = rollout.launch(prompts[:3], params)
    gate.reached(batch.done)
    try:
        stats = load_behind(rollout, gate, new.state_dict(), 1)
        assert stats.bytes > 0 and rollout.version == 1
        after = rollout.generate(prompts[3:5], SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=4))
        generations = batch.result()
    finally:
        if restore:
            rollout.load_weights(old.state_dict(), version=0)
    assert all(g.versions == [(0, 1)] for gens in after for g in gens)
    for gens, prompt in zip(generations, prompts):
        for g in gens:
            split = g.versions[1][0]
            assert g.prompt_ids == list(prompt) and len(g.response_ids) == new_tokens, g.versions
            assert [v for _, v in g.versions] == [0, 1] and 3 <= split < new_tokens, g.versions
            want = (logprobs_under(old, g.prompt_ids, g.response_ids)[:split]
                    + logprobs_under(new, g.prompt_ids, g.response_ids)[split:])
            assert g.logprobs == pytest.approx(want, abs=2e-4)
            assert token_versions(g) == [0] * split + [1] * (new_tokens - split)


@pytest.mark.slow
def test_weights_taken_with_samples_under_way_pause_and_continue_them(streaming, rollout_prompts, tiny_llama):
    """`load_weights` mid-generation (this thread sends, the loop receives): the samples under way are paused
    and go on under the new weights, two spans each; every token's log-prob is that of its span's weights;
    a batch launched after the sync is of the new version alone."""
    assert_paused_and_continued(streaming, rollout_prompts, tiny_llama, 96, restore=True)


@pytest.mark.slow
def test_a_batch_suspended_for_a_checkpoint_goes_on_alike_when_relaunched(streaming, rollout_prompts):
    """`suspend` (a checkpoint with rollout.partial) records a batch under way without waiting for it and lets it
    go on; the state relaunched (a resumed run) makes exactly what the batch that went on made: the same tokens,
    log-probs and spans, the samples that had ended kept as they were."""
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, seed=11, lengths=(3, 40, 40))
    stream = streaming.loop.stream
    gate = Hold(streaming.loop, lambda: len(stream.samples) == 4
                and min(len(s.tokens) for s in stream.samples.values()) >= 5)
    batch = streaming.launch(rollout_prompts[:3], params)
    gate.reached(batch.done)
    (state,) = behind(streaming, gate, streaming.suspend, [batch])
    went_on = batch.result()
    assert state.count == 3 and state.n == 2 and not state.greedy
    assert sorted((i, j) for i, j, _ in state.ended) == [(0, 0), (0, 1)]  # 3 tokens each: ended before the hold
    assert sorted((i, j) for i, j, _ in state.under_way) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(5 <= len(s.tokens) < 40 and s.segment == 1 for _, _, s in state.under_way)
    version = streaming.version
    again = streaming.relaunch(state).result()
    for gens_on, gens_again in zip(went_on, again):
        for on, back in zip(gens_on, gens_again):
            assert back.response_ids == on.response_ids and back.versions == on.versions == [(0, version)]
            assert back.logprobs == pytest.approx(on.logprobs, abs=1e-5)
    assert [len(g.response_ids) for gens in again for g in gens] == [3, 3, 40, 40, 40, 40]
    fresh = streaming.generate(rollout_prompts[1:3], params.part(1, 3))  # a pause changes what follows it
    assert [g.response_ids for gens in fresh for g in gens] != [g.response_ids for gens in went_on[1:] for g in gens]


@pytest.mark.slow
def test_another_family_at_longer_prompts_pauses_and_continues_alike():
    """The same on a tiny Qwen2 (biased attention projections, its own weight names in the sync) with prompts of
    the user's own text, 150-330 tokens: the continuation is prefilled again on prompt + prefix under the new
    weights."""
    pytest.importorskip("vllm")
    from hpcrlhf.engines.rollout.vllm import VLLMRollout
    from hpcrlhf.models.loading import load_tokenizer
    from hpcrlhf.models.tiny import build_tiny_model_dir

    model = str(build_tiny_model_dir("qwen2"))
    tokenizer = load_tokenizer(model)
    text = ("Ledger entry {i}: the warehouse in Tromso shipped {n} crates of cod to the harbour, and the clerk "
            "wrote down every weight twice because the scale had drifted the week before. ")
    prompts = [tokenizer("".join(text.format(i=i, n=17 * i + r) for i in range(2 + r % 2)))["input_ids"]
               for r in range(5)]
    assert 150 <= min(map(len, prompts)) and max(map(len, prompts)) <= 330, [len(p) for p in prompts]
    rollout = StreamingRollout(lambda: VLLMRollout(model, seed=0, max_model_len=512, kv_cache_bytes=1 << 28),
                               partial=True)
    try:
        assert_paused_and_continued(rollout, prompts, model, 48, restore=False)
    finally:
        rollout.close()


class ScriptedEngine:
    """What the loop needs of a `VLLMRollout` when no request is ever sent: a version, an idle vLLM engine."""

    def __init__(self) -> None:
        self.version, self.closed = 0, threading.Event()
        self.llm = SimpleNamespace(llm_engine=SimpleNamespace(has_unfinished_requests=lambda: False))

    def close(self) -> None:
        self.closed.set()


def test_a_failing_message_stops_the_loop_and_every_later_call_names_the_cause():
    engine = ScriptedEngine()
    loop = EngineLoop(lambda: engine, partial=True)
    assert loop.post(lambda: 41 + 1).result() == 42
    with pytest.raises(ZeroDivisionError):
        loop.post(lambda: 1 / 0).result()
    assert engine.closed.wait(10)  # the loop closes its engine when it stops
    with pytest.raises(EngineLoopError, match="division by zero"):
        loop.post(lambda: None)
    loop.close()


def test_an_engine_that_cannot_be_built_fails_the_loop_at_once():
    def broken():
        raise ValueError("no such model folder")

    with pytest.raises(ValueError, match="no such model folder"):
        EngineLoop(broken, partial=False)


def test_a_batch_gives_its_groups_as_they_end_and_fails_with_the_loop():
    batch = StreamBatch(3, 2, greedy=False)
    g = Generation([1], [2], [-0.5], True, versions=[(0, 0)])
    batch.add(2, 0, g)
    batch.add(2, 1, g)
    first = next(iter_groups := batch.as_finished())
    assert [i for i, _ in first] == [2] and batch.finished() is None
    batch.add(0, 0, g)
    batch.fail(RuntimeError("engine died"))
    with pytest.raises(EngineLoopError, match="engine died"):
        next(iter_groups)
    greedy = StreamBatch(1, 4, greedy=True)
    greedy.add(0, 0, g)
    copies = greedy.result()[0]
    assert len(copies) == 4 and all(c.versions == [(0, 0)] and c is not g for c in copies)
    assert StreamBatch(0, 2, greedy=False).result() == []


class DrainingEngine(ScriptedEngine):
    """An engine with one request under way: its first step waits for `go`, its second fails (a dying engine)."""

    def __init__(self) -> None:
        super().__init__()
        self.go, self.steps = threading.Event(), 0
        self.llm.llm_engine.step = self.step

    def step(self):
        self.steps += 1
        if self.steps == 1:
            assert self.go.wait(30)
            return []
        raise RuntimeError("engine died in step 2")


def test_a_loop_that_dies_while_draining_for_a_sync_fails_it_before_anything_is_sent():
    """Without `partial` the loop finishes the samples under way before it receives the weights: an engine that
    dies meanwhile fails `publish` itself (the sender would otherwise wait in the broadcast for a receiver that
    never comes, up to the group's 30-minute timeout), naming the cause; the receive never ran."""
    engine = DrainingEngine()
    loop = EngineLoop(lambda: engine, partial=False)
    loop.post(lambda: loop.stream.requests.update({"0": "b0.0.0"})).result()  # a sample under way: the loop steps
    received, outcome = [], []

    def sync():
        try:
            outcome.append(loop.publish(1, lambda: received.append(1)))
        except EngineLoopError as e:
            outcome.append(e)

    syncing = threading.Thread(target=sync)
    syncing.start()
    time.sleep(0.2)  # the sync is posted while step 1 runs; the loop drains in step 2
    assert not outcome
    engine.go.set()
    syncing.join(30)
    (error,) = outcome
    assert isinstance(error, EngineLoopError) and "before it took the weights of version 1" in str(error)
    assert "engine died in step 2" in str(error) and not received
    assert engine.closed.wait(10)
    loop.close()


def test_a_publish_returns_once_the_loop_receives_and_a_wait_on_a_batch_answers_the_watchdog():
    """`publish` returns the receive's future as soon as it runs (the sender then sends); a caller waiting on a
    batch the loop never ends is interrupted by the watchdog's deadline, which names the loop."""
    from hpcrlhf.config.schema import WatchdogConfig
    from hpcrlhf.run.watchdog import WaitExpired, Watchdog

    loop = EngineLoop(ScriptedEngine, partial=True)
    release = threading.Event()
    future = loop.publish(3, lambda: release.wait(30) and "in")
    assert not future.done() and loop.stream.version == 0  # receiving: the caller would send now
    release.set()
    assert future.result(10) == "in" and loop.stream.version == 3
    dog = Watchdog(WatchdogConfig(first_s=0.3, grace_s=60.0)).start()
    try:
        with pytest.raises(WaitExpired) as hung:
            with dog.phase("generate"):
                StreamBatch(2, 1, greedy=False).result()
    finally:
        dog.stop()
    assert hung.value.expiry.parties == ("the vLLM engine loop (thread hpcrlhf-engine-loop)",)
    loop.close()


def test_a_loop_whose_engine_step_never_returns_is_left_by_close(monkeypatch):
    import hpcrlhf.engines.rollout.loop as loop_module

    monkeypatch.setattr(loop_module, "CLOSE_S", 0.3)
    engine = DrainingEngine()  # its first step waits for `go`, never set here until the end
    loop = EngineLoop(lambda: engine, partial=False)
    loop.post(lambda: loop.stream.requests.update({"0": "b0.0.0"})).result()
    began = time.monotonic()
    loop.close()
    assert time.monotonic() - began < 10 and loop._thread.is_alive() and not engine.closed.is_set()
    engine.go.set()  # the step returns, the loop takes the close and ends
    assert engine.closed.wait(10)
