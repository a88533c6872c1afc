"""`hpcrlhf generate` and `hpcrlhf chat` through the real CLI."""

from __future__ import annotations

import io
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from hpcrlhf.agents.render import ChatRenderer
from hpcrlhf.agents.tools import load_tools
from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import GenerateConfig
from hpcrlhf.data.tasks import ArithmeticTask
from hpcrlhf.engines.rollout.contract import Generation
from hpcrlhf.errors import AgentEnvError, ConfigError, DataError
from hpcrlhf.inference import chat
from hpcrlhf.models.loading import load_tokenizer
from tests.launch_helpers import ROOT, cli_command, cli_env, run_cli


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_generate_scores_every_response_and_matches_the_training_evaluation(policy_model, tmp_path):
    greedy = tmp_path / "greedy.jsonl"
    run_cli(["generate", "-m", policy_model, "-o", str(greedy), "--set", "reward={sources: [{rule: task}, "
             "{rule: task_partial, weight: 0.5}]}"])
    rows = _rows(greedy)
    task = ArithmeticTask()
    assert len(rows) == 256 and {r["sample"] for r in rows} == {0}
    for r in rows:
        exact, partial = task.score(r["prompt"], r["response"]), task.partial_score(r["prompt"], r["response"])
        assert r["task_score"] == exact and r["scores"] == pytest.approx({"rule_task": exact, "rule_task_partial": partial})
        assert r["score"] == pytest.approx(exact + 0.5 * partial)
        assert r["finished"] and r["num_tokens"] >= 2
    # the same greedy answers as the SFT run's own evaluation of this model
    sft_summary = json.loads((Path(policy_model).parent / "summary.json").read_text())
    mean = sum(r["task_score"] for r in rows) / len(rows)
    assert mean == pytest.approx(sft_summary["after"]["eval/task_score"])

    sampled = tmp_path / "sampled.jsonl"
    run_cli(["generate", "-m", policy_model, "-o", str(sampled), "--set", "greedy=false",
             "--set", "rollout.samples_per_prompt=4", "--set", "task.eval_size=16"])
    rows = _rows(sampled)
    assert [r["sample"] for r in rows[:8]] == [0, 1, 2, 3, 0, 1, 2, 3] and len(rows) == 64
    assert len({r["response"] for r in rows[:4]}) > 1 or len({r["logprob"] for r in rows[:4]}) == 1


@pytest.mark.slow
def test_generate_with_vllm_gives_the_same_greedy_answers(policy_model, tmp_path):
    hf, vllm = tmp_path / "hf.jsonl", tmp_path / "vllm.jsonl"
    common = ["-m", policy_model, "--set", "task.eval_size=64"]
    run_cli(["generate", *common, "-o", str(hf)])
    run_cli(["generate", *common, "-o", str(vllm), "--set", "rollout.backend=vllm", "--set", "rollout.vllm_kv_cache_gb=0.25"])
    a, b = _rows(hf), _rows(vllm)
    assert [r["response"] for r in a] == [r["response"] for r in b]
    assert [r["logprob"] for r in a] == pytest.approx([r["logprob"] for r in b], abs=1e-4)


@pytest.mark.slow
def test_generate_runs_each_row_as_a_trajectory_with_the_agent_section(tmp_path):
    """An agent evaluated without training: each row runs as a trajectory of tests.agents.envs:Countdown
    (2 judged turns at 0.1 each, 1.0 at the end) on the tiny llama made to end its turns early; its line
    holds the transcript and counts, and the `env` source scores the environment's rewards."""
    from tests.trainers.ppo.test_agent_e2e import short_turned

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"count {i}", "id": f"row{i}"}) + "\n" for i in range(8)))
    model, out = short_turned("llama", None, tmp_path / "model"), tmp_path / "out.jsonl"
    proc = run_cli(["generate", "-m", model, "-o", str(out), "--set", f"data.train_path={rows}", "--set",
                    "data.apply_chat_template=true", "--set", "task.name=null", "--set", "rollout.max_new_tokens=8",
                    "--set", "agent={environment: 'tests.agents.envs:Countdown', environment_args: {turns: 2}, "
                    "max_turns: 3, max_tokens: 48}", "--set", "reward.sources=[{env: true}]", "--set", "batch_size=3"])
    lines = _rows(out)
    assert [line["prompt"] for line in lines] == [f"count {i}" for i in range(8)]
    done = [line for line in lines if line["status"] == "done"]
    assert len(done) >= 4, [line["status"] for line in lines]
    for line in done:  # by hand: two judged turns and the final reward
        assert line["turns"] == 2 and line["episode_reward"] == pytest.approx(1.2) and line["truncated"] == 0
        assert line["score"] == pytest.approx(1.2) and line["scores"] == {"env": pytest.approx(1.2)}
        assert [m["role"] for m in line["messages"]] == ["system", "user", "assistant", "user", "assistant"]
        assert line["messages"][3]["content"] == "again" and line["response"] == line["messages"][4]["content"]
        assert line["tool_calls"] == 0 and line["success"] in (0.0, 1.0)
    for line in lines:
        if line["status"] != "done":  # cut at the turn's token limit: the judged turns before it, and the end
            assert line["status"] == "max_tokens" and line["truncated"] == 1
            assert line["episode_reward"] == pytest.approx(0.1 * (line["turns"] - 1) + 1.0)
    mean_turns = sum(line["turns"] for line in lines) / len(lines)
    assert f"mean_turns={mean_turns:.4f}" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("sets, field", [
    (["reward.sources=[{env: true}]"], "reward.sources[0].env"),
    (["agent={environment: 'tests.agents.envs:Countdown', schedule: trajectory}"], "agent.schedule"),
    (["agent={environment: 'tests.agents.envs:Countdown', max_tokens: 16}", "rollout.max_new_tokens=32"],
     "agent.max_tokens"),
])
def test_generate_checks_its_agent_settings_before_loading(sets, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(GenerateConfig, overrides=sets)


def test_generate_reads_a_prompt_file_and_names_a_missing_field(tiny_llama, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question": "1+2="}) + "\n" + json.dumps({"question": "3+4="}) + "\n")
    out = tmp_path / 'out "x" #1.jsonl'  # -o is a path, taken literally (it was YAML: this wrote to `out "x"`)
    run_cli(["generate", "-m", tiny_llama, "-o", str(out), "--set", f"data.train_path={prompts}",
             "--set", "data.prompt_key=question", "--set", "task.name=null"])
    assert [r["prompt"] for r in _rows(out)] == ["1+2=", "3+4="] and "task_score" not in _rows(out)[0]
    proc = run_cli(["generate", "-m", tiny_llama, "-o", str(out), "--set", f"data.train_path={prompts}"], check=False)
    assert proc.returncode == 2 and "field 'prompt' is missing" in proc.stderr and "data.prompt_key" in proc.stderr


def a_link(tmp_path: Path) -> Path:
    (tmp_path / "victim").write_text("the user's own file\n")
    (tmp_path / "out.jsonl").symlink_to(tmp_path / "victim")
    return tmp_path / "out.jsonl"


@pytest.mark.parametrize("make, said", [
    (lambda t: t, "{out} is a folder, not a file: hpcrlhf writes a file of its own there; name another file with -o "
                  "(--output)"),
    (lambda t: Path("/dev/full"), "/dev/full is a character device, not a file"),
    (a_link, "{out} is a symbolic link (to {t}/victim); hpcrlhf never writes through links: name another file"),
], ids=["a folder", "/dev/full", "a link"])
def test_generate_refuses_an_output_that_is_no_file_of_its_own_before_loading(tmp_path, make, said):
    out = make(tmp_path)
    proc = run_cli(["generate", "-m", "/nonexistent/model", "-o", str(out)], check=False, timeout=120)
    assert proc.returncode == 2 and said.format(out=out, t=tmp_path) in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out.jsonl").is_symlink() or (tmp_path / "victim").read_text() == "the user's own file\n"


@pytest.mark.slow
def test_chat_answers_each_line_and_resets(policy_model, tmp_path):
    generated = tmp_path / "g.jsonl"
    run_cli(["generate", "-m", policy_model, "-o", str(generated), "--set", "task.eval_size=2"])
    expected = [r["response"] for r in _rows(generated)]
    prompts = [r["prompt"] for r in _rows(generated)]
    proc = subprocess.run(cli_command(["chat", "-m", policy_model, "--raw", "--greedy", "--max-new-tokens", "8"]), cwd=ROOT,
                          env=cli_env(), input=f"{prompts[0]}\n/reset\n\n{prompts[1]}\n/quit\nignored\n",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [expected[0], "(conversation reset)", expected[1]]


def test_chat_with_an_environment_through_the_cli(tiny_llama):
    """`hpcrlhf chat --environment` on the real engine: piped rows, the environment's arguments as JSON
    (Countdown ends after one judged turn, not its default 3: the untrained model's first turn ends with EOS)."""
    proc = subprocess.run(cli_command(["chat", "-m", tiny_llama, "--greedy", "--max-new-tokens", "4",
                                       "--environment", "tests.agents.envs:Countdown", "--environment-args",
                                       '{"turns": 1}', "--max-turns", "3"]),
                          cwd=ROOT, env=cli_env(), input='{"id": "a"}\n{"id": "b"}\n', capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 8 and [lines[i] for i in (0, 4)] == ["system: Count."] * 2, proc.stdout
    assert all(re.fullmatch(r"env: start \d", lines[i]) and lines[i + 1].startswith("model: ") for i in (1, 5))
    assert [lines[i] for i in (3, 7)] == ["(episode: done, 1 turn(s), 0 tool call(s), reward 1.1, no success)"] * 2


def test_chat_reads_a_message_of_several_lines(tiny_llama):
    """A `\"""` block and lines joined by trailing backslashes are one message each (the same text,
    so the same greedy answer); before, each of these 6 lines was a message of its own."""
    proc = subprocess.run(cli_command(["chat", "-m", tiny_llama, "--raw", "--greedy", "--max-new-tokens", "1"]),
                          cwd=ROOT, env=cli_env(), input='"""\n1+2=\n3+4=\n"""\n1+2=\\\n3+4=\n',
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = proc.stdout.splitlines()
    assert len(answers) == 2 and answers[0] == answers[1], proc.stdout


class ScriptedChat:
    """A rollout engine whose turns say `replies` in order, each ending with EOS; it keeps the prompts
    it was given."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self.tok, self.replies, self.prompts, self.closed = tokenizer, list(replies), [], False

    def reply_ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]

    def generate(self, prompts, params):
        self.prompts.append(list(prompts[0]))
        ids = self.reply_ids(self.replies.pop(0))
        return [[Generation(list(prompts[0]), ids, [0.0] * len(ids), True)]]

    def close(self) -> None:
        self.closed = True


CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


def test_chat_runs_the_models_tool_calls_and_goes_on_from_its_own_tokens(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    engine = ScriptedChat(tok, [CALL, "= 42", "hello"])
    out = io.StringIO()
    chat(tiny_llama, tools=["tests.agents.envs:multiply"], greedy=True, stdin=io.StringIO("what is 6*7?\nhi\n"),
         stdout=out, engine=engine)
    assert out.getvalue().splitlines() == ["tool: multiply: 42", "= 42", "hello"] and engine.closed
    renderer = ChatRenderer(tok, [t.schema for t in load_tools(["tests.agents.envs:multiply"])])
    first = renderer.prompt([{"role": "user", "content": "what is 6*7?"}])
    # token in, token out: the second turn reads the first turn's own tokens, then the tool's answer
    assert engine.prompts[:2] == [first, first + engine.reply_ids(CALL) + renderer.observation(
        [{"role": "tool", "name": "multiply", "content": "42"}])]
    assert engine.prompts[2][:len(first) - 1] == first[:-1] and len(engine.prompts[2]) > len(engine.prompts[1])


def test_chat_answers_a_hung_tool_with_a_timeout_and_refuses_tools_without_a_template(tiny_llama):
    tok = load_tokenizer(tiny_llama)
    engine = ScriptedChat(tok, ['<tool_call>{"name": "sleepy", "arguments": {"seconds": 30}}</tool_call>', "late"])
    out, began = io.StringIO(), time.monotonic()
    chat(tiny_llama, tools=["tests.agents.envs:sleepy"], tool_timeout_s=0.5, greedy=True, stdin=io.StringIO("wait\n"),
         stdout=out, engine=engine)
    assert out.getvalue().splitlines() == ["tool: sleepy: error: timeout: no answer within 0.5 s (--tool-timeout)",
                                           "late"]
    assert time.monotonic() - began < 10
    with pytest.raises(ConfigError, match="--tool: tools reach the model through its chat template: drop --raw"):
        chat(tiny_llama, tools=["tests.agents.envs:multiply"], raw=True, stdin=io.StringIO(""),
             engine=ScriptedChat(tok, []))
    with pytest.raises(ConfigError, match="--tool"):
        chat(tiny_llama, tools=["tests.agents.envs:nosuch"], stdin=io.StringIO(""), engine=ScriptedChat(tok, []))


def test_chat_with_an_environment_runs_each_message_as_an_episode_and_shows_its_transcript(tiny_llama):
    """A message that is a JSON object is the row (tests.agents.envs:Calculator reads its answer), the model's
    call of the environment's tool is answered, its answer judged by `step`; an environment step that raises
    ends that episode (env_error), shown, and the chat goes on; a message whose row the environment's reset
    refuses ends piped input with the reset's error."""
    tok = load_tokenizer(tiny_llama)
    engine = ScriptedChat(tok, [CALL, "= 42", CALL, "= 40"])
    out = io.StringIO()
    rows = '{"prompt": "what is 6*7?", "answer": "42"}\n/reset\n{"prompt": "and 6*7?", "answer": "41"}\n'
    chat(tiny_llama, environment="tests.agents.envs:Calculator", greedy=True, stdin=io.StringIO(rows), stdout=out,
         engine=engine)
    transcript = ["env: what is 6*7?", f"model: {CALL}", "tool: multiply: 42", "model: = 42",
                  "(episode: done, 2 turn(s), 1 tool call(s), reward 1, success)"]
    assert out.getvalue().splitlines() == [
        *transcript, "(each message starts an episode of its own)", "env: and 6*7?", *transcript[1:3], "model: = 40",
        "(episode: done, 2 turn(s), 1 tool call(s), reward 0, no success)"] and engine.closed
    out = io.StringIO()
    chat(tiny_llama, environment="tests.agents.envs:Broken", max_turns=3, greedy=True,
         stdin=io.StringIO('{"id": 1}\n'), stdout=out, engine=ScriptedChat(tok, ["a", "b"]))
    *lines, outcome = out.getvalue().splitlines()
    assert lines == ["env: go", "model: a", "env: more", "model: b"], out.getvalue()
    assert outcome.startswith("(episode: env_error, 2 turn(s), 0 tool call(s), reward 0, error: agent.environment "
                              "'tests.agents.envs:Broken' (row message 1, seed ") and \
        re.search(r"\.step raised RuntimeError: the simulator crashed at \S+envs\.py:\d+ in step on turn 2; fix the "
                  r"class\)$", outcome), outcome
    with pytest.raises(AgentEnvError, match=r"KeyError: 'no such puzzle'"):
        chat(tiny_llama, environment="tests.agents.envs:Broken", stdin=io.StringIO('{"id": "bad-reset"}\n'),
             stdout=io.StringIO(), engine=ScriptedChat(tok, []))
    with pytest.raises(DataError, match=r"message 1: it starts with '\{' but is no JSON object"):
        chat(tiny_llama, environment="tests.agents.envs:Broken", stdin=io.StringIO('{"id": \n'),
             stdout=io.StringIO(), engine=ScriptedChat(tok, []))


@pytest.mark.parametrize("kwargs, expected", [
    ({"environment": "tests.agents.envs:Calculator", "system": "Be brief."}, "--system: with --environment each message "
     "starts an episode of its own"),
    ({"environment": "tests.agents.envs:Calculator", "max_tool_rounds": 2}, "--max-tool-rounds: with --environment"),
    ({"environment": "tests.agents.envs:Calculator", "max_new_tokens": 400}, r"--max-new-tokens: 400 leaves no room "
     r"for an episode's other turns in half of the 512 positions .*; use at most 256"),
    ({"environment": "tests.agents.envs"}, "--environment: 'tests.agents.envs' .*package.module:Class"),
    ({"environment": "tests.agents.envs:Nope"}, "tests.agents.envs' has no 'Nope'"),
    ({"environment": "tests.agents.envs:Calculator", "environment_args": {"digits": 3}},
     r"--environment-args: \{'digits': 3\} do not fit tests.agents.envs:Calculator's constructor"),
    ({"environment": "tests.agents.envs:Calculator", "tools": ["tests.agents"]}, r"--tool\[0\] 'tests.agents' is no tool"),
    ({"environment": "tests.agents.envs:Calculator", "tool_parser": "nope"}, "--tool-parser: 'nope'"),
    ({"max_turns": 3}, "--max-turns: for an episode with --environment; name the environment, or drop --max-turns"),
])
def test_chat_with_an_environment_refuses_what_it_cannot_honour_before_a_model_loads(tiny_llama, kwargs, expected):
    with pytest.raises(ConfigError, match=expected):
        chat(tiny_llama, stdin=io.StringIO("hi\n"), stdout=io.StringIO(), engine=ScriptedChat(load_tokenizer(tiny_llama),
                                                                                               []), **kwargs)


@pytest.mark.parametrize("option, value, expected", [
    ("--max-new-tokens", "0", "argument --max-new-tokens: 0 is not a number of tokens to generate: use 1 or more"),
    ("--max-new-tokens", "-5", "argument --max-new-tokens: -5 is not a number of tokens to generate: use 1 or more"),
    ("--temperature", "0", "argument --temperature: 0 is not a sampling temperature: use a finite number above 0"),
    ("--temperature", "-1", "argument --temperature: -1 is not a sampling temperature: use a finite number above 0"),
    ("--temperature", "nan", "argument --temperature: nan is not a sampling temperature: use a finite number above 0"),
    ("--temperature", "inf", "argument --temperature: inf is not a sampling temperature: use a finite number above 0"),
    ("--max-tool-rounds", "0", "argument --max-tool-rounds: 0 is not a number of tool rounds: use 1 or more"),
    ("--tool-timeout", "-1", "argument --tool-timeout: -1 is not a number of seconds: use a finite number above 0"),
    ("--max-turns", "0", "argument --max-turns: 0 is not a number of model turns: use 1 or more"),
    ("--environment-args", "[1]", """argument --environment-args: '[1]' is no JSON object; use one, e.g. '{"high": 50}'"""),
    ("--environment-args", "{high: 1}", "argument --environment-args: '{high: 1}' is no JSON (Expecting property name "
                                        "enclosed in double quotes); use an object"),
])
def test_chat_arguments_out_of_range_are_refused_before_a_model_loads(option, value, expected, tmp_path, capsys):
    """Each was a ValueError traceback from SamplingParams once the model had loaded (rc 1); inf sampled noise."""
    from hpcrlhf.cli import main

    with pytest.raises(SystemExit) as e:
        main(["chat", "-m", str(tmp_path / "no-model"), option, value])
    assert e.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.parametrize("given, expected", [
    (b"1+2=\n3+\xff4=\n", "hpcrlhf: error: stdin line 2 is not UTF-8 text (byte 0xff at byte 3 of the line): chat "
                           "reads UTF-8 text"),
    (b"1+2=\n" + b"9" * (2 << 20), "hpcrlhf: error: stdin line 2 is longer than 1 MiB: chat reads a message per line"),
])
def test_chat_input_that_is_no_text_message_is_an_error_naming_its_line(tiny_llama, given, expected):
    """Binary input reached the tokenizer as lone surrogates (a TypeError traceback); a line with no end was
    read whole into memory."""
    proc = subprocess.run(cli_command(["chat", "-m", tiny_llama, "--raw", "--greedy", "--max-new-tokens", "1"]),
                          cwd=ROOT, env=cli_env(), input=given, capture_output=True, timeout=300)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and expected in err and "Traceback" not in err, err[-3000:]
    assert len(proc.stdout.decode().splitlines()) == 1  # line 1 was answered


def test_read_message_joins_lines():
    import io

    from hpcrlhf.inference import read_message

    stdin = io.StringIO('a\nb \\\nc\n"""\nx\n  y\n"""\n"""one"""\n"""p\nq"""\n/reset\n"""\nnever closed\n')
    messages = iter(lambda: read_message(stdin, io.StringIO(), interactive=False), None)
    assert list(messages) == ["a", "b \nc", "x\n  y", "one", "p\nq", "/reset", "never closed"]
    shown = io.StringIO()
    assert read_message(io.StringIO("a \\\nb\n"), shown, interactive=True) == "a \nb"
    assert shown.getvalue() == "you> ...> "  # prompts only at a terminal
