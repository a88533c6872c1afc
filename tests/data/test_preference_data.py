"""Preference and unpaired data: malformed rows are named by file and line before any model is
loaded; pairs and KTO's mismatched sequences are tokenised as specified."""

from __future__ import annotations

import json

import pytest

from hpcrlhf.config.schema import PairDataConfig, UnpairedDataConfig
from hpcrlhf.data.preference import check_pair_rows, check_unpaired_rows, tokenize_pairs, tokenize_unpaired
from hpcrlhf.data.sft import keep_usable
from hpcrlhf.data.sources import Row, read_rows
from hpcrlhf.data.tasks import ArithmeticTask
from hpcrlhf.errors import DataError
from tests.launch_helpers import run_cli

GOOD = {"prompt": "1+2=", "chosen": "3", "rejected": "4"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("bad, needle", [
    ({"prompt": "1+2=", "chosen": "3"}, "field 'rejected' is missing"),
    ({"prompt": "1+2=", "chosen": "  ", "rejected": "4"}, "field 'chosen' is empty"),
    ({"prompt": "", "chosen": "3", "rejected": "4"}, "field 'prompt' is empty"),
    ({"prompt": "1+2=", "chosen": "3", "rejected": "3 "}, "'chosen' and 'rejected' are identical"),
    ({"prompt": "1+2=", "chosen": 3, "rejected": "4"}, "field 'chosen' must be a string"),
])
def test_malformed_pairs_are_named_by_file_and_line(tmp_path, bad, needle):
    path = write_jsonl(tmp_path / "pairs.jsonl", [GOOD, GOOD, bad])
    with pytest.raises(DataError) as e:
        check_pair_rows(read_rows(str(path)), PairDataConfig(max_length=64))
    assert f"{path}:3:" in str(e.value) and needle in str(e.value)


def test_margin_must_be_a_number(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{**GOOD, "m": 1.5}, {**GOOD, "m": "big"}])
    with pytest.raises(DataError, match=rf"{path}:2: field 'm' \(data.margin_key\) must be a finite number"):
        check_pair_rows(read_rows(str(path)), PairDataConfig(margin_key="m", max_length=64))


@pytest.mark.parametrize("label", ["yes", 2, None])
def test_unpaired_label_must_be_boolean(tmp_path, label):
    path = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "1+2=", "completion": "3", "label": True},
                                                {"prompt": "1+2=", "completion": "4", "label": label}])
    with pytest.raises(DataError, match=rf"{path}:2: field 'label' \(data.label_key\) must be true or false"):
        check_unpaired_rows(read_rows(str(path)), UnpairedDataConfig(max_length=64))


def test_cli_reports_bad_preference_file_before_training(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [GOOD, {"prompt": "2+2=", "chosen": "4", "rejected": "4"}])
    proc = run_cli(["train", "dpo", "-o", str(tmp_path / "run"), "--set", f"data.train_path={path}",
                    "--set", "task.name=null"], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{path}:2: 'chosen' and 'rejected' are identical" in proc.stderr and "Traceback" not in proc.stderr


def test_pairs_tokenise_like_sft_samples(tokenizer):
    rows = [Row({**GOOD, "difficulty": "hard"}, "x:1")]
    (pair,), truncation = tokenize_pairs(rows, tokenizer, PairDataConfig(max_length=64))
    prompt = tokenizer("1+2=", add_special_tokens=True)["input_ids"]
    assert list(pair.chosen.input_ids) == prompt + tokenizer("3", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert pair.chosen.loss_mask == (False,) * len(prompt) + (True,) * (len(pair.chosen.input_ids) - len(prompt))
    assert pair.tag == "hard" and pair.margin == 0.0 and truncation.cut == 0 and truncation.usable == (True,)


def test_pairs_identical_after_truncation_are_left_out_and_none_left_is_an_error(tokenizer):
    """A prompt filling data.max_length leaves chosen and rejected the same tokens: such a pair
    teaches nothing and is left out; when no pair is left the error names the setting."""
    long = Row({"prompt": "1+2+3+4+5+6+7+8+9=", "chosen": "45", "rejected": "46"}, "x:7")
    pairs, truncation = tokenize_pairs([long, Row(GOOD, "x:8")], tokenizer, PairDataConfig(max_length=8))
    assert truncation.usable == (False, True) and truncation.prompt_tokens[0] > 8
    assert keep_usable(pairs, truncation, split="training", path="x.jsonl") == pairs[1:]
    with pytest.raises(DataError, match=r"data.max_length=8 tokens leaves nothing to learn from in any of the 1 "
                                        r"training rows of x.jsonl \(data.train_path\): each lost the difference "
                                        r"between chosen and rejected"):
        keep_usable(*tokenize_pairs([long], tokenizer, PairDataConfig(max_length=8)), split="training", path="x.jsonl")


def test_kto_mismatched_sequence_is_own_prompt_plus_next_rows_completion(tokenizer):
    rows = [Row({"prompt": f"{i}+1=", "completion": str(i + 1), "label": i % 2 == 0}, f"x:{i}") for i in range(3)]
    samples = tokenize_unpaired(rows, tokenizer, UnpairedDataConfig(max_length=64))
    enc = lambda text, special: tokenizer(text, add_special_tokens=special)["input_ids"]  # noqa: E731
    for i, s in enumerate(samples):
        j = (i + 1) % 3
        assert list(s.mismatched.input_ids) == enc(f"{i}+1=", True) + enc(str(j + 1), False) + [tokenizer.eos_token_id]
        assert s.desirable == (i % 2 == 0)
    with pytest.raises(DataError, match="at least 2 rows"):
        tokenize_unpaired(rows[:1], tokenizer, UnpairedDataConfig(max_length=64))


def test_mixed_preference_rows():
    task = ArithmeticTask()
    rows = task.mixed_preference_rows("train", 2000, 0.3)
    assert rows[:50] == task.mixed_preference_rows("train", 50, 0.3)  # prefix-stable
    hard = task.preference_rows("train", 2000, hard=True)
    easy = task.preference_rows("train", 2000)
    for row, h, e in zip(rows, hard, easy):
        assert {k: row[k] for k in h} == (h if row["difficulty"] == "hard" else e)
    share = sum(r["difficulty"] == "hard" for r in rows) / len(rows)
    assert 0.26 < share < 0.34
    assert all(r["difficulty"] == "easy" for r in task.mixed_preference_rows("eval", 100, 0.0))


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from hpcrlhf.models.loading import load_tokenizer

    return load_tokenizer(tiny_llama)
