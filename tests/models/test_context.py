"""Generation lengths are checked against the model's positions (issue 36, item 5): before anything
loads, a response length no prompt fits with; where prompts are read, each prompt plus its response.
`rollout.max_new_tokens=100000000` used to run for minutes into gigabytes of memory."""

from __future__ import annotations

import io
import json
import subprocess

import pytest

from hpcrlhf.errors import ConfigError, DataError
from hpcrlhf.models.context import ContextWindow, positions_in
from tests.launch_helpers import ROOT, cli_command, cli_env, run_cli

HUGE = 100_000_000
HELD = "more than the 512 positions of model.path"


def test_positions_are_read_from_the_usual_entries():
    assert positions_in({"max_position_embeddings": 4096}) == (4096, "max_position_embeddings")
    assert positions_in({"n_positions": 1024, "n_ctx": 1024}) == (1024, "n_positions")
    assert positions_in({"text_config": {"max_position_embeddings": 8192}}) == (8192, "max_position_embeddings")
    assert positions_in({"hidden_size": 8}) == (None, "")


def test_the_window_names_both_numbers_and_the_fix():
    window = ContextWindow("model.path", "m", 512, "max_position_embeddings")
    window.require_response_fits("rollout.max_new_tokens", 511)
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens: 512 tokens cannot follow even a one-token prompt "
                                          r"within the 512 positions of model.path 'm' \(max_position_embeddings in its "
                                          r"config.json\); use at most 511 minus the longest prompt's tokens"):
        window.require_response_fits("rollout.max_new_tokens", 512)
    window.require_prompt_fits(500, "rollout.max_new_tokens", 12, "p.jsonl:3")
    with pytest.raises(DataError, match=r"p.jsonl:3: the prompt has 500 tokens, and with rollout.max_new_tokens 13 the "
                                        r"sequence would be 513 tokens, more than the 512 positions .*; lower "
                                        r"rollout.max_new_tokens to at most 12 or shorten the prompt"):
        window.require_prompt_fits(500, "rollout.max_new_tokens", 13, "p.jsonl:3")
    ContextWindow("model.path", "m", None).require_response_fits("rollout.max_new_tokens", HUGE)  # no limit known


@pytest.mark.parametrize("args, field", [
    (["train", "ppo", "--set", f"rollout.max_new_tokens={HUGE}"], "rollout.max_new_tokens"),
    (["train", "sft", "--set", f"eval.max_new_tokens={HUGE}"], "eval.max_new_tokens"),
    (["generate", "--set", f"rollout.max_new_tokens={HUGE}"], "rollout.max_new_tokens"),
    # a trajectory's tokens after its first prompt (the model's turns and the answers)
    (["generate", "--set", f"agent={{environment: 'tests.agents.envs:Countdown', max_tokens: {HUGE}}}"],
     "agent.max_tokens"),
])
def test_a_response_longer_than_the_model_is_refused_before_anything_loads(tmp_path, args, field):
    out = tmp_path / "out"
    proc = run_cli([*args, "-o", str(out)], check=False, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"hpcrlhf: error: {field}: {HUGE} tokens cannot follow even a one-token prompt within the 512 positions " \
           "of model.path 'builtin:tiny-llama' (max_position_embeddings in its config.json); use at most 511" \
           in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()  # nothing written


def test_generate_names_the_prompt_that_does_not_fit_before_the_model_loads(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+2="}) + "\n" + json.dumps({"prompt": "12+" * 200}) + "\n")
    proc = run_cli(["generate", "-o", str(tmp_path / "out.jsonl"), "--set", f"data.train_path={prompts}",
                    "--set", "task.name=null", "--set", "rollout.max_new_tokens=8"], check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"hpcrlhf: error: {prompts}:2: the prompt has 600 tokens, and with rollout.max_new_tokens 8 the sequence " \
           f"would be 608 tokens, {HELD} 'builtin:tiny-llama'" in proc.stderr, proc.stderr[-3000:]
    assert "shorten the prompt to fewer than 512 tokens" in proc.stderr
    assert "loading" not in proc.stderr.lower()


def chat(args: list[str], lines: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command(["chat", "-m", "builtin:tiny-llama", "--raw", "--greedy", *args]), cwd=ROOT,
                          env=cli_env(), input=lines, capture_output=True, text=True, timeout=120)


def test_chat_refuses_too_many_new_tokens_and_a_message_too_long_for_the_model():
    proc = chat(["--max-new-tokens", str(HUGE)], "1+2=\n")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"hpcrlhf: error: --max-new-tokens: {HUGE} tokens cannot follow even a one-token prompt within the 512 " \
           "positions of --model 'builtin:tiny-llama'" in proc.stderr, proc.stderr[-3000:]
    # piped input is a script: a message the model cannot hold ends it (exit 2), answering what came before
    proc = chat(["--max-new-tokens", "4"], "1+2=\n" + "12+" * 4_000 + "\n3+4=\n")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(proc.stdout.splitlines()) == 1  # the first message's answer, then nothing
    assert "hpcrlhf: error: message 2: the prompt has 12000 tokens, and with --max-new-tokens 4 the sequence would " \
           "be 12004 tokens, more than the 512 positions of --model 'builtin:tiny-llama'" in proc.stderr, proc.stderr[-3000:]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_at_a_terminal_a_message_too_long_is_refused_and_the_chat_goes_on(capsys):
    from hpcrlhf.inference import chat

    out = io.StringIO()
    status = chat("builtin:tiny-llama", raw=True, greedy=True, max_new_tokens=4, stdin=Terminal("12+" * 200 + "\n1+2=\n"),
                  stdout=out)
    assert status == 0 and out.getvalue().count("model> ") == 1, out.getvalue()  # the second message is answered
    assert "hpcrlhf: message 1: the prompt has 600 tokens, and with --max-new-tokens 4 the sequence would be 604 tokens" \
           in capsys.readouterr().err


def test_a_model_without_a_position_limit_is_said_and_not_checked(tmp_path, caplog):
    import logging

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with caplog.at_level(logging.INFO, logger="hpcrlhf"):
        window = ContextWindow.of(str(tmp_path), say_unlimited=True)
    assert window.positions is None
    assert f"model.path '{tmp_path}': its config.json names no position limit" in caplog.text
    window.require_response_fits("rollout.max_new_tokens", HUGE)
    window.require_prompt_fits(HUGE, "rollout.max_new_tokens", HUGE, "p.jsonl:1")
