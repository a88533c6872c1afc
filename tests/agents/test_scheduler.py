"""The trajectory scheduler on a scripted engine (a `RequestEngine` whose turns take a set number of
engine steps and say a set text): each trajectory on its own clock, the turn schedule's barrier,
limits, timeouts, environment errors, tools and rewards -- the tokens and records they leave."""

from __future__ import annotations

import time

import pytest

from hpcrlhf.agents.environments import load_environment
from hpcrlhf.agents.episode import Episode, EpisodeLimits, Setup, join_spans
from hpcrlhf.agents.parsers import hermes
from hpcrlhf.agents.pool import EnvPool
from hpcrlhf.agents.render import ChatRenderer
from hpcrlhf.agents.scheduler import TurnOutput, mixed_seed, run_episodes
from hpcrlhf.engines.rollout.contract import token_versions
from hpcrlhf.errors import AgentEnvError
from hpcrlhf.models.loading import load_tokenizer


class ScriptedEngine:
    """Turn t of trajectory k says `say(k, t)`: (text, engine steps it takes, ends with EOS)."""

    def __init__(self, tokenizer, say, synchronous: bool = False) -> None:
        self.tok, self.say, self.synchronous = tokenizer, say, synchronous
        self.queue: dict[str, list] = {}
        self.turns: dict[str, int] = {}
        self.submitted: list[tuple[str, int, float, int | None, int]] = []  # key, turn, when, seed, max tokens
        self.polls = 0  # calls of running(): how often the scheduler looked

    def submit(self, request) -> None:
        turn = self.turns.get(request.key, 0)
        self.turns[request.key] = turn + 1
        text, steps, finished = self.say(request.key, turn)
        ids = self.tok(text, add_special_tokens=False)["input_ids"] + ([self.tok.eos_token_id] if finished else [])
        cut = len(ids) > request.max_new_tokens
        self.queue[request.key] = [1 if self.synchronous else steps, ids[:request.max_new_tokens], finished and not cut]
        self.submitted.append((request.key, turn, time.monotonic(), request.seed, request.max_new_tokens))

    def step(self) -> list[TurnOutput]:
        time.sleep(0.01)
        out = []
        for key, item in list(self.queue.items()):
            item[0] -= 1
            if item[0] <= 0:
                del self.queue[key]
                out.append(TurnOutput(key, item[1], [-0.5] * len(item[1]), item[2]))
        return out

    def running(self) -> int:
        self.polls += 1
        return len(self.queue)

    def abort(self, keys) -> None:
        for k in keys:
            self.queue.pop(k, None)


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return load_tokenizer(tiny_llama)


@pytest.fixture
def pool():
    p = EnvPool(4)
    yield p
    p.close()


def episodes(tok, pool, env, args=None, rows=None, tools=(), **limits):
    environment = load_environment(env, args or {})
    schemas = [t.schema for t in (*tools, *environment.tools)]
    setup = Setup(environment, tools, ChatRenderer(tok, schemas), hermes, tok, EpisodeLimits(**limits), pool)
    return [Episode(str(i), row, 100 + i, setup, f"rows.jsonl:{i + 1}") for i, row in enumerate(rows)]


def test_each_trajectory_runs_on_its_own_clock_and_the_turn_schedule_waits_for_all(tok, pool):
    """Trajectory 0's environment takes 0.4 s a turn, trajectory 1's none: on its own clock 1 runs all
    three turns before 0's first answer; turn by turn it waits for 0 every round, blocked, not polling."""
    for schedule in ("trajectory", "turn"):
        rows = [{"id": "slow"}, {"id": "fast"}]
        eps = episodes(tok, pool, "tests.agents.envs:Countdown", {"latency": {"slow": 0.4}}, rows)
        engine = ScriptedEngine(tok, lambda key, turn: (f"turn {turn} ok", 2, True))
        stats = run_episodes(engine, eps, pool, max_new_tokens=16, seed=7, schedule=schedule)
        when = {(k, t): at for k, t, at, _, _ in engine.submitted}
        if schedule == "trajectory":
            assert when[("1", 2)] < when[("0", 1)]  # the fast one finished before the slow one's second turn
        else:
            assert when[("1", 1)] > when[("0", 0)] + 0.35 and when[("1", 2)] > when[("0", 1)] + 0.35
        assert stats.engine_idle_s > 0.3 and stats.env_calls == 2 * (1 + 3 + 1)
        # waiting for an environment blocks: the turn schedule's barrier spun (314,523 polls for this batch)
        assert engine.polls < 100, (schedule, engine.polls)
        for ep in eps:
            r = ep.record
            assert (r.status, r.turns, r.turn_rewards, r.final_reward, r.success, r.info) == \
                ("done", 3, [0.1] * 3, 1.0, True, {"score": 2.0})
            assert r.reward == pytest.approx(1.3) and ep.env.closed
            assert [m["role"] for m in r.messages] == ["system", "user", "assistant", "user", "assistant", "user",
                                                       "assistant"]
            assert r.final_text == "turn 2 ok"
    assert rows[0]["id"] == "slow"  # reset got a copy
    # seeds: per trajectory and turn, the same whatever the schedule
    assert sorted((k, t, s) for k, t, _, s, _ in engine.submitted) == sorted(
        (str(i), t, mixed_seed(7, i, t)) for i in range(2) for t in range(3))


def test_the_transcript_is_the_models_tokens_as_sampled_and_the_environments_answers(tok, pool):
    (ep,) = episodes(tok, pool, "tests.agents.envs:Countdown", {"turns": 2}, [{"id": "a"}])
    engine = ScriptedEngine(tok, lambda key, turn: (f"say {turn}", 1, True))
    run_episodes(engine, [ep], pool, max_new_tokens=16, seed=1)
    said = [tok(f"say {t}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in range(2)]
    again = ep.setup.renderer.observation([{"role": "user", "content": "again"}])
    assert ep.ids == said[0] + again + said[1]
    assert ep.action == [True] * len(said[0]) + [False] * len(again) + [True] * len(said[1])
    assert ep.logprobs == [-0.5] * len(said[0]) + [0.0] * len(again) + [-0.5] * len(said[1])
    assert ep.record.turn_ends == [len(said[0]) - 1, len(ep.ids) - 1]
    # the template's whole render, but for the "\n" it writes after the model's last EOS
    assert tok.decode(ep.prompt_ids + ep.ids) + "\n" == tok.apply_chat_template(
        [{"role": "system", "content": "Count."}, {"role": "user", "content": "start 0"},
         {"role": "assistant", "content": "say 0"}, {"role": "user", "content": "again"},
         {"role": "assistant", "content": "say 1"}], tokenize=False)


def test_join_spans_puts_a_turns_spans_after_the_trajectorys_and_joins_a_version_that_goes_on():
    assert join_spans([], 0, [(0, 3)]) == [(0, 3)]
    assert join_spans([(0, 3)], 7, [(0, 3), (2, 4)]) == [(0, 3), (9, 4)]  # paused 2 tokens into the turn at 7
    assert join_spans([(0, 3), (9, 4)], 15, [(0, 4)]) == [(0, 3), (9, 4)]
    assert join_spans([(0, 3)], 5, [(0, 4)]) == [(0, 3), (5, 4)]  # the update came between turns


class VersionedEngine(ScriptedEngine):
    """Turn t's tokens carry the spans `spans[t]` (turn-relative), as an engine loop's turns do."""

    def __init__(self, tokenizer, say, spans) -> None:
        super().__init__(tokenizer, say)
        self.spans = spans

    def step(self) -> list[TurnOutput]:
        return [TurnOutput(o.key, o.token_ids, o.logprobs, o.finished, self.spans[self.turns[o.key] - 1])
                for o in super().step()]


def test_a_trajectory_records_the_versions_of_its_turns_spans_and_the_environments_tokens_lie_in_the_one_before(
        tok, pool):
    """Turn 0 under version 3, turn 1 paused after 2 tokens and continued under 4, turn 2 under 4: the
    trajectory's spans are (0, 3) and (start of turn 1 + 2, 4); the environment's answer after turn 0 is of 3.
    A plain engine's turns record none: the trajectory's versions stay None (the trainer stamps its launch's)."""
    say = lambda key, turn: (f"say {turn} more", 1, True)  # noqa: E731
    (ep,) = episodes(tok, pool, "tests.agents.envs:Countdown", {"turns": 3}, [{"id": "a"}])
    run_episodes(VersionedEngine(tok, say, [[(0, 3)], [(0, 3), (2, 4)], [(0, 4)]]), [ep], pool, max_new_tokens=16,
                 seed=1)
    (plain,) = episodes(tok, pool, "tests.agents.envs:Countdown", {"turns": 3}, [{"id": "a"}])
    run_episodes(ScriptedEngine(tok, say), [plain], pool, max_new_tokens=16, seed=1)
    starts = [i for i, a in enumerate(ep.action) if a and (i == 0 or not ep.action[i - 1])]
    assert len(starts) == 3 and ep.record.turns == 3
    g = ep.generation()
    assert g.versions == [(0, 3), (starts[1] + 2, 4)]
    assert token_versions(g) == [3] * (starts[1] + 2) + [4] * (len(ep.ids) - starts[1] - 2)
    assert plain.generation().versions is None and plain.ids == ep.ids


def test_turn_and_token_limits_end_a_trajectory_on_the_models_tokens(tok, pool):
    rows = [{"id": "a"}]
    (turns,) = episodes(tok, pool, "tests.agents.envs:Countdown", {"turns": 9}, rows, max_turns=2)
    run_episodes(ScriptedEngine(tok, lambda k, t: ("x", 1, True)), [turns], pool, max_new_tokens=8, seed=1)
    assert (turns.record.status, turns.record.turns, turns.action[-1]) == ("max_turns", 2, True)
    (cut,) = episodes(tok, pool, "tests.agents.envs:Countdown", {"turns": 9}, rows)
    run_episodes(ScriptedEngine(tok, lambda k, t: ("a long answer", 1, False)), [cut], pool, max_new_tokens=4, seed=1)
    assert (cut.record.status, cut.record.turns, len(cut.ids)) == ("max_tokens", 1, 4)
    (full,) = episodes(tok, pool, "tests.agents.envs:Countdown", {"turns": 9}, rows, max_tokens=12)
    engine = ScriptedEngine(tok, lambda k, t: ("x", 1, True))
    run_episodes(engine, [full], pool, max_new_tokens=8, seed=1)
    # 2 tokens a turn, "again" answers take 11: after the first turn there was no room for another
    assert (full.record.status, full.record.turns, full.ids, full.action) == (
        "max_tokens", 1, tok("x", add_special_tokens=False)["input_ids"] + [tok.eos_token_id], [True, True])
    assert [m for _, _, _, _, m in engine.submitted] == [8]


def test_tools_are_called_answered_and_counted(tok, pool):
    rows = [{"prompt": "37*59=", "answer": 2183, "id": i} for i in range(4)]
    scripts = {"0": ['<tool_call>{"name": "multiply", "arguments": {"a": 37, "b": 59}}</tool_call>', "= 2183"],
               "1": ['<tool_call>{"name": "divide", "arguments": {}}</tool_call><tool_call>{"name": "add", '
                     '"arguments": {"a": 2, "b": 3}}</tool_call><tool_call>{oops</tool_call>', "= 5"],
               "2": ['<tool_call>{"name": "multiply", "arguments": {"a": -1, "b": 2}}</tool_call>', "= 2183"],
               "3": ["= 2183"]}
    eps = episodes(tok, pool, "tests.agents.envs:Calculator", rows=rows)
    run_episodes(ScriptedEngine(tok, lambda k, t: (scripts[k][t], 1, True)), eps, pool, max_new_tokens=160, seed=1)
    r = [ep.record for ep in eps]
    assert [x.status for x in r] == ["done"] * 4 and [x.turns for x in r] == [2, 2, 2, 1]
    assert [x.reward for x in r] == [1.0, 0.0, 1.0, 1.0] and [x.success for x in r] == [True, False, True, True]
    # the turns that called tools were not judged: the step's reward follows the model's last turn
    assert [x.reward_turns for x in r] == [[1], [1], [1], [0]] and [len(x.turn_ends) for x in r] == [2, 2, 2, 1]
    assert r[0].tool_calls == {"multiply": 1} and r[0].tool_errors == {}
    assert r[0].messages[1:3] == [{"role": "assistant", "content": scripts["0"][0]},
                                  {"role": "tool", "name": "multiply", "content": "2183"}]
    assert r[1].tool_calls == {"divide": 1, "add": 1, "invalid": 1}
    assert r[1].tool_errors == {"unknown": 1, "malformed": 1}
    assert [m["content"] for m in r[1].messages[2:5]] == [
        "error: unknown: no tool named 'divide'; the tools are add, multiply", "5",
        "error: malformed: not JSON (Expecting property name enclosed in double quotes at character 1)"]
    assert r[2].tool_errors == {"raised": 1, "multiply": 1}
    assert r[2].messages[2]["content"] == "error: raised: ValueError: negative factor"


def test_a_hung_tool_ends_its_trajectory_and_the_others_finish(tok, pool):
    rows = [{"prompt": "0*5=", "answer": 0, "id": 0}, {"prompt": "2*5=", "answer": 10, "id": 1}]
    scripts = {"0": ['<tool_call>{"name": "multiply", "arguments": {"a": 0, "b": 5}}</tool_call>'], "1": ["= 10"]}
    eps = episodes(tok, pool, "tests.agents.envs:Calculator", rows=rows, step_timeout_s=0.3)
    start = time.monotonic()
    stats = run_episodes(ScriptedEngine(tok, lambda k, t: (scripts[k][t], 1, True)), eps, pool, max_new_tokens=64,
                         seed=1, max_failed_share=0.5)
    assert time.monotonic() - start < 2.0  # not the tool's 30 s
    assert [ep.record.status for ep in eps] == ["timeout", "done"] and stats.timeouts == 1 and stats.abandoned_calls == 1
    assert "Calculator' (row rows.jsonl:1, seed 100).after_turn took longer than 0.3 s" in eps[0].record.error
    eps = episodes(tok, pool, "tests.agents.envs:Calculator", rows=rows, step_timeout_s=0.3)
    with pytest.raises(AgentEnvError, match=r"1 of 2 trajectories ended by a timeout or an environment error, more "
                                            r"than agent.max_failed_share \(0.2\); the first: .*took longer than 0.3 s"):
        run_episodes(ScriptedEngine(tok, lambda k, t: (scripts[k][t], 1, True)), eps, pool, max_new_tokens=64, seed=1,
                     max_failed_share=0.2)


def test_batches_sharing_a_pool_count_only_their_own_abandoned_calls(tok, pool):
    """Two batches at once on one pool (an engine loop's batches ahead): the one whose tool hangs counts the thread
    it gave up, the other -- running while it was given up -- none."""
    from concurrent.futures import ThreadPoolExecutor

    rows = [{"prompt": "0*5=", "answer": 0, "id": 0}]
    script = '<tool_call>{"name": "multiply", "arguments": {"a": 0, "b": 5}}</tool_call>'
    hung = episodes(tok, pool, "tests.agents.envs:Calculator", rows=rows, step_timeout_s=0.3)
    slow = episodes(tok, pool, "tests.agents.envs:Countdown", {"latency": {"a": 0.25}}, [{"id": "a"}])
    with ThreadPoolExecutor(2) as threads:
        other = threads.submit(run_episodes, ScriptedEngine(tok, lambda k, t: ("ok", 1, True)), slow, pool,
                               max_new_tokens=16, seed=1)
        own = threads.submit(run_episodes, ScriptedEngine(tok, lambda k, t: (script, 1, True)), hung, pool,
                             max_new_tokens=64, seed=1, max_failed_share=1.0)
        own_stats, other_stats = own.result(timeout=30), other.result(timeout=30)
    assert other_stats.wall_s > 0.6 and slow[0].record.status == "done"  # it ran while the hung call was given up
    assert (own_stats.timeouts, own_stats.abandoned_calls) == (1, 1)
    assert (other_stats.timeouts, other_stats.abandoned_calls) == (0, 0)


def test_environment_errors_fail_the_batch_or_end_the_trajectory_as_configured(tok, pool):
    engine = ScriptedEngine(tok, lambda k, t: ("move", 1, True))
    with pytest.raises(AgentEnvError, match=r"agent.environment 'tests.agents.envs:Broken' \(row rows.jsonl:2, seed 101\)"
                                            r".reset raised KeyError: 'no such puzzle' at .*envs.py:\d+ in reset; fix"):
        run_episodes(engine, episodes(tok, pool, "tests.agents.envs:Broken", rows=[{"id": "ok"}, {"id": "bad-reset"}]),
                     pool, max_new_tokens=8, seed=1)
    with pytest.raises(AgentEnvError, match=r"\.step raised RuntimeError: the simulator crashed at .* on turn 2"):
        run_episodes(ScriptedEngine(tok, lambda k, t: ("move", 1, True)),
                     episodes(tok, pool, "tests.agents.envs:Broken", rows=[{"id": "ok"}]), pool, max_new_tokens=8, seed=1)
    eps = episodes(tok, pool, "tests.agents.envs:Broken", rows=[{"id": "ok"}, {"id": "ok"}], on_env_error="end")
    stats = run_episodes(ScriptedEngine(tok, lambda k, t: ("move", 1, True)), eps, pool, max_new_tokens=8, seed=1)
    assert [(ep.record.status, ep.record.turns) for ep in eps] == [("env_error", 2)] * 2 and stats.env_errors == 2
    assert "the simulator crashed" in eps[0].record.error


def test_an_engine_that_generates_a_batch_at_once_runs_turn_by_turn(tok, pool):
    eps = episodes(tok, pool, "tests.agents.envs:Countdown", {"turns": 2}, [{"id": "a"}, {"id": "b"}])
    engine = ScriptedEngine(tok, lambda k, t: ("ok", 1, True), synchronous=True)
    with pytest.raises(ValueError, match="runs turn by turn: use schedule='turn'"):
        run_episodes(engine, eps, pool, max_new_tokens=8, seed=1)
    run_episodes(engine, eps, pool, max_new_tokens=8, seed=1, schedule="turn")
    assert [ep.record.status for ep in eps] == ["done", "done"]


def test_a_cancelled_batch_stops_its_turns_and_still_closes_every_environment(tok, pool):
    """`cancelled()` turning true mid-batch (arrival order dropping a group too old to train): the turns in the engine
    are aborted, no later turn starts, and every environment still gets its last say (its close) -- none leaks. A
    trajectory whose environment answers slowly (0.3 s a turn) is cut after its first turn; the batch ends in well
    under the ~0.9 s its three turns would take."""
    rows = [{"id": "slow"}, {"id": "stuck"}]
    eps = episodes(tok, pool, "tests.agents.envs:Countdown", {"latency": {"slow": 0.3}}, rows)
    engine = ScriptedEngine(tok, lambda key, turn: (f"turn {turn} ok", 2 if key == "0" else 10 ** 6, True))
    start = time.monotonic()
    stop_at = start + 0.2  # during the slow environment's first answer; trajectory 1's turn never ends
    stats = run_episodes(engine, eps, pool, max_new_tokens=16, seed=7, cancelled=lambda: time.monotonic() > stop_at)
    took = time.monotonic() - start
    assert took < 0.6, took
    assert not engine.queue  # trajectory 1's turn was aborted in the engine
    assert sorted((k, t) for k, t, *_ in engine.submitted) == [("0", 0), ("1", 0)]  # no turn started after the stop
    assert all(ep.env.closed for ep in eps) and stats.env_calls == 2 + 1 + 2  # resets, 0's first answer, finishes


def test_an_episode_batch_tells_its_end_once_and_its_cancel_reaches_the_run():
    """`EpisodeBatch`: the run gets its `cancelled`; a done callback fires once, on the batch's thread or at once if
    added after the end."""
    import threading

    from hpcrlhf.agents.runner import EpisodeBatch

    seen, told, go = [], [], threading.Event()

    def run(cancelled):
        go.wait(5)
        seen.append(cancelled())
        return [], None

    batch = EpisodeBatch(run)
    batch.add_done_callback(lambda: told.append("early"))
    assert not batch.done()
    batch.cancel()
    go.set()
    assert batch.result() == [] and batch.done() and seen == [True]
    deadline = time.monotonic() + 5
    while not told and time.monotonic() < deadline:
        time.sleep(0.01)
    batch.add_done_callback(lambda: told.append("late"))
    assert told == ["early", "late"] and batch.finished() is not None
