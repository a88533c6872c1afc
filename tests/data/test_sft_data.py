"""What `data.max_length` may cut from prompt + response rows, through the real CLI, for every job
kind that trains on them: a split it leaves nothing to learn from is refused naming the file, the
setting and the longest prompt; rows it empties are left out and counted; most responses cut is a
loud warning. Before: SFT and CSFT died in `nll_step` with ZeroDivisionError, KTO trained on empty
responses, DPO and RM named one row; an eval file of such rows silently dropped `eval/loss`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrlhf.run.metrics import read_metrics
from tests.launch_helpers import run_cli

QUICK = ["--set", "train.max_steps=2", "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=4",
         "--set", "eval.max_new_tokens=2", "--set", "log.backends=[]", "--set", "log.progress=false",
         "--set", "checkpoint.save_model=false"]

LONG_PROMPT = "Say the word {w} and nothing else, please:"
"""19 tokens or more for the bundled tokenizer: longer than data.max_length=16."""

WORDS = ("red", "blue", "green", "gold") * 2


def rows_for(kind: str, prompt: str = LONG_PROMPT) -> list[dict]:
    """Rows of the fields `kind` trains on, every prompt `prompt` (with `{w}` a word)."""
    out = []
    for i, w in enumerate(WORDS):
        row = {"prompt": prompt.format(w=w)}
        if kind in ("sft", "csft"):
            row.update(response=w, reward=float(i % 2))
        elif kind in ("rm", "dpo"):
            row.update(chosen=w, rejected=f"not {w}")
        else:
            row.update(completion=w, label=i % 2 == 0)
        out.append(row)
    return out


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("kind", ["sft", "csft", "rm", "dpo", "kto"])
def test_max_length_leaving_no_response_token_fails_before_training(tmp_path, kind):
    train = write_jsonl(tmp_path / "train.jsonl", rows_for(kind))
    out = tmp_path / "run"
    proc = run_cli(["train", kind, "-o", str(out), "--set", f"data.train_path={train}", "--set", "data.max_length=16",
                    *QUICK], check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lost = "the difference between chosen and rejected" if kind in ("rm", "dpo") else "every response token"
    assert (f"hpcrlhf: error: data.max_length=16 tokens leaves nothing to learn from in any of the 8 training rows of "
            f"{train} (data.train_path): each lost {lost} to the cut") in proc.stderr, proc.stderr[-3000:]
    assert "raise data.max_length above the longest prompt (" in proc.stderr, proc.stderr[-3000:]
    assert not read_metrics(out)  # it failed before the first evaluation


def test_most_responses_cut_warns_with_counts_and_leaves_out_empty_rows(tmp_path):
    """7 of 8 rows longer than data.max_length=16: 6 keep part of their response (not the EOS),
    1 (a 19-token prompt) keeps none and is left out; training goes on with 7 rows."""
    rows = ([{"prompt": "Name a colour:", "response": "red green blue yellow"}] * 6
            + [{"prompt": LONG_PROMPT.format(w="red"), "response": "red"}, {"prompt": "Q:", "response": "ok"}])
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    proc = run_cli(["train", "sft", "-o", str(tmp_path / "run"), "--set", f"data.train_path={train}",
                    "--set", "data.max_length=16", *QUICK], timeout=300)
    assert (f"data.max_length=16 tokens cuts the responses of 7 of the 8 training rows of {train} (data.train_path); "
            "1 of them lost every response token and are left out. Most responses lose their end (EOS): the model "
            "will not learn where a response ends") in proc.stderr, proc.stderr[-3000:]
    assert "raise data.max_length above the longest prompt (19 tokens); 22 keeps every sample whole" in proc.stderr
    assert "sft: 7 training rows" in proc.stderr, proc.stderr[-3000:]


def test_an_eval_file_every_row_of_which_is_cut_to_nothing_fails_naming_it(tmp_path):
    """Before: the run went on and `eval/loss` was missing from every evaluation without a word."""
    train = write_jsonl(tmp_path / "train.jsonl", rows_for("sft", "{w}?"))
    evals = write_jsonl(tmp_path / "eval.jsonl", rows_for("sft")[:3])
    proc = run_cli(["train", "sft", "-o", str(tmp_path / "run"), "--set", f"data.train_path={train}",
                    "--set", f"data.eval_path={evals}", "--set", "data.max_length=16", *QUICK],
                   check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (f"hpcrlhf: error: data.max_length=16 tokens leaves nothing to learn from in any of the 3 eval rows of "
            f"{evals} (data.eval_path): each lost every response token to the cut") in proc.stderr, proc.stderr[-3000:]
    assert "so eval/loss cannot be computed; raise data.max_length above the longest prompt" in proc.stderr
