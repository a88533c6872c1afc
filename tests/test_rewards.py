"""Reward sources and their combination: two reward models of known output (checked against
transformers' own sequence-classification pooling in float64), rules, penalties and errors."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from hpcrlhf.config.loader import load_config
from hpcrlhf.config.schema import GenerateConfig, RewardConfig, RewardSourceConfig
from hpcrlhf.data.tasks import ArithmeticTask
from hpcrlhf.engines.deepspeed_engine import FrozenModel
from hpcrlhf.errors import ConfigError, RuleError
from hpcrlhf.models.loading import load_tokenizer
from hpcrlhf.models.value import ValueModel, load_value_model
from hpcrlhf.rewards.response import Response
from hpcrlhf.rewards.sources import RewardSet, adjust_scores

CPU = torch.device("cpu")


def _make_rm(base: str, folder, seed: int, mean: float, std: float) -> str:
    """A reward model with a random head (seeded) and stored normalisation statistics."""
    torch.manual_seed(seed)
    model = load_value_model(base, pad_token_id=0)
    model.config.reward_mean, model.config.reward_std = mean, std
    model.save_pretrained(folder)
    load_tokenizer(base).save_pretrained(folder)
    return str(folder)


def _load(path: str, field: str = "reward.sources[0].model") -> FrozenModel:
    tok = load_tokenizer(path)
    return FrozenModel(ValueModel(load_value_model(path, pad_token_id=tok.pad_token_id)), None, CPU)


def _reference_reward(path: str, ids: list[int]) -> float:
    """transformers' own pooled score of one unpadded sequence, in float64, normalised."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float64).eval()
    with torch.no_grad():
        raw = float(model(input_ids=torch.tensor([ids])).logits[0, 0])
    return (raw - model.config.reward_mean) / model.config.reward_std


def _responses(tokenizer, n: int = 6) -> list[Response]:
    task = ArithmeticTask()
    out = []
    for i, row in enumerate(task.prompt_rows("eval", n)):
        answer = str(task.answer(row["prompt"]) + (i % 2))  # every other answer is off by one
        ids = tokenizer(row["prompt"])["input_ids"] + tokenizer(answer, add_special_tokens=False)["input_ids"]
        out.append(Response(row["prompt"], answer, tuple(ids + [tokenizer.eos_token_id]), row))
    return out


def test_two_reward_models_and_a_rule_are_combined_as_configured(tiny_llama, tmp_path):
    rm_a = _make_rm(tiny_llama, tmp_path / "rm_a", seed=1, mean=0.3, std=2.0)
    rm_b = _make_rm(tiny_llama, tmp_path / "rm_b", seed=2, mean=-1.0, std=0.5)
    tokenizer = load_tokenizer(tiny_llama)
    cfg = RewardConfig(sources=(RewardSourceConfig(model=rm_a, weight=0.7), RewardSourceConfig(model=rm_b, weight=-1.3),
                                RewardSourceConfig(rule="task", weight=2.0)), batch_size=4)
    rewards = RewardSet(cfg, _load, tokenizer, ArithmeticTask(), CPU)
    responses = _responses(tokenizer)
    total, parts = rewards.score(responses)
    assert list(parts) == ["model0_rm_a", "model1_rm_b", "rule_task"]
    for i, r in enumerate(responses):
        a, b = _reference_reward(rm_a, list(r.sequence_ids)), _reference_reward(rm_b, list(r.sequence_ids))
        rule = 1.0 if i % 2 == 0 else 0.0
        assert parts["model0_rm_a"][i].item() == pytest.approx(a, abs=1e-5)
        assert parts["model1_rm_b"][i].item() == pytest.approx(b, abs=1e-5)
        assert parts["rule_task"][i].item() == rule
        assert total[i].item() == pytest.approx(0.7 * a - 1.3 * b + 2.0 * rule, abs=1e-5)
    assert len({round(x, 6) for x in parts["model0_rm_a"].tolist()}) > 1  # the models really differ per response
    rules = RewardSet(RewardConfig(sources=(RewardSourceConfig(rule="task"),)), _load, tokenizer, ArithmeticTask(), CPU)
    assert rewards.has_models and not rules.has_models  # (a reward model's forwards: collective under ZeRO-3)


def test_unnormalized_source_and_user_rule(tiny_llama, tmp_path, monkeypatch):
    rm = _make_rm(tiny_llama, tmp_path / "rm", seed=3, mean=5.0, std=10.0)
    (tmp_path / "myrules.py").write_text("def length(prompt, response, row):\n    return float(len(response)) + row['bonus']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tokenizer = load_tokenizer(tiny_llama)
    cfg = RewardConfig(sources=(RewardSourceConfig(model=rm, normalize=False), RewardSourceConfig(rule="myrules:length")))
    rewards = RewardSet(cfg, _load, tokenizer, None, CPU)
    r = Response("1+2=", "3", tuple(tokenizer("1+2=")["input_ids"] + tokenizer("3", add_special_tokens=False)["input_ids"]),
                 {"bonus": 0.5})
    total, parts = rewards.score([r])
    raw = _reference_reward(rm, list(r.sequence_ids)) * 10.0 + 5.0  # undo the reference's normalisation
    assert parts["model0_rm"].item() == pytest.approx(raw, abs=1e-5)
    assert parts["rule_myrules.length"].item() == 1.5
    assert total.item() == pytest.approx(raw + 1.5, abs=1e-5)


@pytest.mark.parametrize("rule, message", [("nosuch", "use a known rule (math, code, format, task, task_partial)"),
                                           ("maths", "(did you mean 'math'?)"), ("nosuchmodule:f", "cannot be imported"),
                                           ("json:dumps", "(prompt, response, row)")])
def test_bad_rules_fail_before_anything_loads(rule, message, tiny_llama):
    """A name that is no rule fails when the config loads; a function that cannot be imported or has
    the wrong signature, before any reward model loads."""
    loaded = []
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg = RewardConfig(sources=(RewardSourceConfig(model="never-loaded"), RewardSourceConfig(rule=rule)))
        RewardSet(cfg, loaded.append, load_tokenizer(tiny_llama), ArithmeticTask(), CPU)
    assert loaded == []


def test_task_rule_needs_a_task(tiny_llama):
    with pytest.raises(ConfigError, match="task.name is null"):
        RewardSet(RewardConfig(), _load, load_tokenizer(tiny_llama), None, CPU)


def test_source_needs_exactly_one_kind():
    with pytest.raises(ConfigError, match="exactly one of `model`"):
        RewardSourceConfig(model="x", rule="task")
    with pytest.raises(ConfigError, match="exactly one of `model`"):
        load_config(GenerateConfig, None, ["reward.sources=[{weight: 2}]"])


def test_penalties_by_hand():
    cfg = RewardConfig(length_penalty=0.1, missing_eos_penalty=-1.0)
    out = adjust_scores(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([2, 8, 3]), torch.tensor([True, False, True]), cfg, 8)
    torch.testing.assert_close(out, torch.tensor([0.8, -0.8, -0.3]))
    assert adjust_scores(torch.tensor([1.0]), torch.tensor([5]), torch.tensor([False]), RewardConfig(), 8).tolist() == [1.0]


def test_overlong_shaping_is_dapos_linear_ramp():
    """DAPO eq. 13 with L_max = 20, L_cache = 4, penalty 0.5, by hand: free up to 16 tokens, then
    -0.5 * (length - 16) / 4 down to -0.5 at 20; on top of the other penalties."""
    cfg = RewardConfig(overlong_buffer=4, overlong_penalty=0.5, missing_eos_penalty=-1.0)
    lengths = torch.tensor([3, 16, 17, 18, 19, 20])
    finished = torch.tensor([True, True, True, True, True, False])
    out = adjust_scores(torch.ones(6), lengths, finished, cfg, 20)
    want = [1.0, 1.0, 1.0 - 0.125, 1.0 - 0.25, 1.0 - 0.375, 1.0 - 0.5 - 1.0]
    assert out.tolist() == pytest.approx(want, abs=1e-7)
    assert adjust_scores(torch.ones(6), lengths, finished, RewardConfig(), 20).tolist() == [1.0] * 5 + [1.0]


@pytest.mark.parametrize("override, message", [
    ("reward.overlong_buffer=-1", "reward.overlong_buffer: -1 is invalid: use 0 (off)"),
    ("reward.overlong_buffer=8", "reward.overlong_buffer: 8 is invalid: use fewer tokens than rollout.max_new_tokens (8)"),
    ("reward.overlong_penalty=-0.5", "reward.overlong_penalty: -0.5 is invalid: use >= 0"),
])
def test_overlong_settings_are_checked_against_the_response_limit(override, message):
    from hpcrlhf.config.schema import PPOConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(PPOConfig, None, [override, "rollout.max_new_tokens=8"])


# ---------------------------------------------------------------- a user's rule: what it may return, how it fails
USER_RULES = '''\
def fails(prompt, response, row):
    if row["id"] == 2:
        return 1 / 0
    return 1.0


def none(prompt, response, row):
    return None if row["id"] == 2 else 1.0


def text(prompt, response, row):
    return "1.0" if row["id"] == 2 else 1.0


def value(prompt, response, row):
    return row["value"]
'''


def _user_rules(tmp_path, monkeypatch) -> str:
    (tmp_path / "userrules.py").write_text(USER_RULES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "userrules", raising=False)  # this test's copy, not an earlier test's
    return str(tmp_path / "userrules.py")


def _score_one(rule: str, row: dict, origin: str = "prompts.jsonl:7") -> torch.Tensor:
    rewards = RewardSet(RewardConfig(sources=(RewardSourceConfig(rule="task", weight=0.0), RewardSourceConfig(rule=rule))),
                        _load, None, ArithmeticTask(), CPU)
    return rewards.score([Response("1+2=", "3", (), row, origin)])[1][f"rule_{rule.replace(':', '.')}"]


@pytest.mark.parametrize("value, expected", [
    (0.25, 0.25), (3, 3.0), (True, 1.0), (False, 0.0),  # a pass/fail check counts 1 or 0
    (__import__("numpy").float32(0.5), 0.5), (__import__("numpy").bool_(True), 1.0), (torch.tensor(0.75), 0.75),
    (__import__("fractions").Fraction(1, 4), 0.25),
])
def test_a_rule_returns_a_real_number(value, expected, tmp_path, monkeypatch):
    _user_rules(tmp_path, monkeypatch)
    assert _score_one("userrules:value", {"value": value}).tolist() == [expected]


def test_a_non_finite_reward_is_left_to_the_nan_guard(tmp_path, monkeypatch):
    """NaN and Inf are real numbers: the guard (`train.on_nonfinite`) skips or stops the step that would
    learn from them, naming the source; an integer too large for a float is +-Inf."""
    _user_rules(tmp_path, monkeypatch)
    assert torch.isnan(_score_one("userrules:value", {"value": float("nan")})).all()
    assert _score_one("userrules:value", {"value": -10**400}).tolist() == [float("-inf")]


@pytest.mark.parametrize("value, shown", [
    (None, "returned None (NoneType)"), ("1.0", "returned '1.0' (str)"), ([1.0], "returned [1.0] (list)"),
    (1j, "returned 1j (complex)"), (torch.tensor([1.0, 2.0]), "(Tensor)"),
])
def test_a_rule_returning_no_number_is_named_with_its_row(value, shown, tmp_path, monkeypatch):
    _user_rules(tmp_path, monkeypatch)
    with pytest.raises(RuleError) as err:
        _score_one("userrules:value", {"value": value})
    message = str(err.value)
    assert message.startswith("reward.sources[1].rule 'userrules:value' returned ") and shown in message, message
    assert "prompt '1+2=' (prompts.jsonl:7)" in message and "real number" in message, message


def test_an_exception_in_a_rule_names_rule_row_and_line(tmp_path, monkeypatch):
    path = _user_rules(tmp_path, monkeypatch)
    with pytest.raises(RuleError) as err:
        _score_one("userrules:fails", {"id": 2})
    message = str(err.value)
    assert message.startswith("reward.sources[1].rule 'userrules:fails' raised ZeroDivisionError: division by zero "
                              f"at {path}:3 in fails, on the response '3' to prompt '1+2=' (prompts.jsonl:7)"), message


@pytest.mark.parametrize("rule, needle", [
    ("fails", "raised ZeroDivisionError: division by zero at {module}:3 in fails"),
    ("none", "returned None (NoneType)"),
    ("text", "returned '1.0' (str)"),
])
def test_generate_names_the_failing_rule_and_the_prompt_row(rule, needle, tiny_llama, tmp_path):
    """Before: a raw traceback naming neither rule nor prompt, a bare TypeError for None, and "1.0"
    accepted as 1.0."""
    import json

    from tests.launch_helpers import run_cli

    (tmp_path / "userrules.py").write_text(USER_RULES)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1=", "id": i}) + "\n" for i in (1, 2)))
    proc = run_cli(["generate", "-m", tiny_llama, "-o", str(tmp_path / "out.jsonl"), "--set", f"data.train_path={prompts}",
                    "--set", f"reward={{sources: [{{rule: 'userrules:{rule}'}}]}}", "--set", "rollout.max_new_tokens=2"],
                   check=False, env={"PYTHONPATH": str(tmp_path)}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"hpcrlhf: error: reward.sources[0].rule 'userrules:{rule}' "), error
    assert needle.format(module=tmp_path / "userrules.py") in error and f"to prompt '2+1=' ({prompts}:2)" in error, error


def test_rule_names_lists_every_user_function_of_a_config(tmp_path, monkeypatch):
    """What a cluster submission checks before queueing: every `module:function` (reward rules and
    metrics; the task's rules import nothing), each with the field that names it."""
    from hpcrlhf.config.schema import PPOConfig
    from hpcrlhf.rewards.rules import check_rules, rule_names

    cfg = load_config(PPOConfig, overrides=["reward.sources=[{rule: task}, {rule: 'userrules:value'}]",
                                            "eval.metrics=[userrules:none, nosuchmodule:f]"])
    assert rule_names(cfg) == [("reward.sources[1].rule", "userrules:value"), ("eval.metrics[0]", "userrules:none"),
                               ("eval.metrics[1]", "nosuchmodule:f")]
    gen = load_config(GenerateConfig, overrides=["metrics=[userrules:text]"])
    assert rule_names(gen) == [("metrics[0]", "userrules:text")]
    _user_rules(tmp_path, monkeypatch)
    check_rules(gen)
    with pytest.raises(ConfigError, match=r"^eval\.metrics\[1\]: rule 'nosuchmodule:f' cannot be imported"):
        check_rules(cfg)


def test_a_metric_must_be_finite_and_not_named_like_the_task_score(tmp_path, monkeypatch):
    from hpcrlhf.rewards.rules import EvalMetrics

    _user_rules(tmp_path, monkeypatch)
    metrics = EvalMetrics(["userrules:value"], ArithmeticTask())
    values = metrics.values([Response("1+2=", "3", (), {"value": 0.5}), Response("2+2=", "5", (), {"value": True})])
    assert values == {"task_score": [1.0, 0.0], "value": [0.5, 1.0]}
    assert metrics.stats([Response("1+2=", "3", (), {"value": 0.5})], "_top") == {"eval/task_score_top": (1.0, 1),
                                                                                  "eval/value_top": (0.5, 1)}
    with pytest.raises(RuleError, match=r"^eval\.metrics\[0\] 'userrules:value' returned nan on the response '3' to "
                                        r"prompt '1\+2=' \(eval.jsonl:3\): an evaluation metric must be finite"):
        metrics.values([Response("1+2=", "3", (), {"value": float("nan")}, "eval.jsonl:3")])
    (tmp_path / "clash.py").write_text("def task_score(prompt, response, row):\n    return 0\n")
    with pytest.raises(ConfigError, match=r"eval\.metrics\[0\]: 'clash:task_score' would be reported as eval/task_score"):
        EvalMetrics(["clash:task_score"], ArithmeticTask())
    assert list(EvalMetrics(["clash:task_score"], None).rules) == ["task_score"]  # no task, no clash


def test_a_metric_named_like_one_the_job_reports_is_refused():
    from hpcrlhf.trainers.loop import merge_evaluation

    assert merge_evaluation({"eval/loss": 1.0}, {"eval/exact": 0.5}) == {"eval/loss": 1.0, "eval/exact": 0.5}
    with pytest.raises(ConfigError, match="a metric function named 'loss' is reported as eval/loss, which this job's "
                                          "evaluation reports already; rename the function"):
        merge_evaluation({"eval/loss": 1.0, "eval/task_score": 0.0}, {"eval/loss": 0.5})


def test_ppo_names_a_rule_it_cannot_import_before_any_model_loads(tmp_path):
    """Before: the actor (and critic, reference) loaded first, then the import failed."""
    from tests.launch_helpers import run_cli

    proc = run_cli(["train", "ppo", "-o", str(tmp_path / "run"), "--set", "reward.sources=[{rule: task}, {rule: 'nosuch:f'}]",
                    "--set", "log.progress=false"], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "hpcrlhf: error: reward.sources[1].rule: rule 'nosuch:f' cannot be imported (ModuleNotFoundError: No module " \
           "named 'nosuch')" in proc.stderr, proc.stderr[-3000:]
    assert "LOAD REPORT" not in proc.stderr  # what transformers prints when it loads the critic's value model


# ---------------------------------------------------------------- the user's code exits, hangs, mutates its row (issue 36)
UNRULY = '''\
import sys
import time


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def exits(prompt, response, row):
    sys.exit(0)


def interrupts(prompt, response, row):
    raise KeyboardInterrupt


def unprintable(prompt, response, row):
    raise Unprintable()


def sleeps(prompt, response, row):
    time.sleep(3600)


def spins(prompt, response, row):
    while True:
        pass


def spins_and_swallows(prompt, response, row):
    while True:
        try:
            time.sleep(3600)
        except Exception:
            pass


def mutates(prompt, response, row):
    row["n"] = -1
    row["nested"].append("x")
    return 0.0


def reads(prompt, response, row):
    return row["n"] + len(row["nested"])
'''


def _unruly(tmp_path, monkeypatch) -> str:
    (tmp_path / "unruly.py").write_text(UNRULY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "unruly", raising=False)
    return str(tmp_path / "unruly.py")


def _unruly_score(rule: str, row: dict | None = None, **reward) -> dict[str, torch.Tensor]:
    cfg = RewardConfig(sources=tuple(RewardSourceConfig(rule=r) for r in rule.split(",")), **reward)
    return RewardSet(cfg, _load, None, ArithmeticTask(), CPU).score([Response("1+2=", "3", (), row or {}, "p.jsonl:4")])[1]


@pytest.mark.parametrize("rule, said", [
    ("exits", "raised SystemExit (sys.exit(0)) at {path}:11 in exits, which would end the job: a rule returns a number"),
    ("interrupts", "raised KeyboardInterrupt at {path}:15 in interrupts, which would end the job: a rule returns"),
    ("unprintable", "raised Unprintable (its message cannot be shown) at {path}:19 in unprintable, on the"),
])
def test_a_rule_that_exits_or_cannot_be_printed_is_an_error_naming_it(rule, said, tmp_path, monkeypatch):
    """`sys.exit(0)` in a metric used to end the job with status 0 and nothing saved."""
    path = _unruly(tmp_path, monkeypatch)
    with pytest.raises(RuleError) as err:
        _unruly_score(f"unruly:{rule}")
    message = str(err.value)
    assert message.startswith(f"reward.sources[0].rule 'unruly:{rule}' {said.format(path=path)}"), message
    assert "on the response '3' to prompt '1+2=' (p.jsonl:4)" in message, message


@pytest.mark.parametrize("rule", ["sleeps", "spins", "spins_and_swallows"])
def test_a_rule_that_never_returns_ends_at_its_deadline(rule, tmp_path, monkeypatch):
    import signal
    import time

    _unruly(tmp_path, monkeypatch)
    start = time.monotonic()
    with pytest.raises(RuleError, match=rf"^reward.sources\[0\].rule 'unruly:{rule}' did not return within 0.5 s "
                                        r"\(reward.rule_timeout_s\) on the response '3' to prompt '1\+2=' \(p.jsonl:4\)"):
        _unruly_score(f"unruly:{rule}", rule_timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_rules_and_metrics_get_a_copy_of_the_row(tmp_path, monkeypatch):
    """A rule that changed `row` changed what the next rule, the metrics and later evaluations saw."""
    from hpcrlhf.rewards.rules import EvalMetrics

    _unruly(tmp_path, monkeypatch)
    row = {"n": 3, "nested": ["a"]}
    parts = _unruly_score("unruly:mutates,unruly:reads", row)
    assert parts["rule_unruly.reads"].tolist() == [4.0] and row == {"n": 3, "nested": ["a"]}
    metrics = EvalMetrics(["unruly:mutates", "unruly:reads"], None)
    assert metrics.values([Response("1+2=", "3", (), row)]) == {"mutates": [0.0], "reads": [4.0]}
    assert row == {"n": 3, "nested": ["a"]}


def test_the_deadline_is_a_setting_a_rerun_may_change():
    from hpcrlhf.config.schema import EvalConfig
    from hpcrlhf.run.folder import is_safe_change

    assert RewardConfig().rule_timeout_s == EvalConfig().metric_timeout_s == GenerateConfig().metric_timeout_s == 300
    for bad in (0, -1, float("inf")):
        with pytest.raises(ConfigError, match="reward.rule_timeout_s"):
            RewardConfig(rule_timeout_s=bad)
    assert is_safe_change("reward.rule_timeout_s") and is_safe_change("eval.metric_timeout_s")


def test_generate_with_a_metric_that_exits_fails_naming_it(tiny_llama, tmp_path):
    """It used to end `hpcrlhf generate` (and training jobs) with status 0 and nothing written."""
    from tests.launch_helpers import run_cli

    (tmp_path / "unruly.py").write_text(UNRULY)
    out = tmp_path / "out.jsonl"
    proc = run_cli(["generate", "-m", tiny_llama, "-o", str(out), "--set", "metrics=[unruly:exits]", "--set",
                    "task.eval_size=2"], check=False, env={"PYTHONPATH": str(tmp_path)}, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "hpcrlhf: error: metrics[0] 'unruly:exits' raised SystemExit (sys.exit(0)) at " in proc.stderr, \
        proc.stderr[-3000:]
    assert "in exits, which would end the job" in proc.stderr


def test_a_stop_signal_is_honoured_while_a_rule_never_returns(tmp_path):
    """SIGTERM (Slurm's preemption) while the user's rule spins: the run stops at once and exits 3
    (it used to hang until killed)."""
    import signal
    import subprocess
    import time

    from hpcrlhf.run.signals import EXIT_REQUEUE
    from tests.launch_helpers import ROOT, cli_command, cli_env

    (tmp_path / "unruly.py").write_text(UNRULY)
    proc = subprocess.Popen(cli_command(["train", "ppo", "-o", str(tmp_path / "run"), "--set",
                                         "reward.sources=[{rule: 'unruly:spins_and_swallows'}]", "--set",
                                         "task.eval_size=4", "--set", "log.progress=false"]),
                            cwd=ROOT, env=cli_env(PYTHONPATH=str(tmp_path)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "key settings:" in line:  # the evaluation before training is next: the rule spins in it
                break
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_REQUEUE and "Traceback" not in log, log[-3000:]
    assert "stop requested during the evaluation before training: no step done, nothing to checkpoint" in log, log[-3000:]


def test_the_environment_source_gives_each_trajectory_its_rewards_beside_a_rule():
    """`{env: true}`: a trajectory's turn rewards plus its end reward, weighted like any source; the
    rule beside it scores the trajectory's text."""
    from hpcrlhf.agents.record import EpisodeRecord

    cfg = RewardConfig(sources=(RewardSourceConfig(env=True, weight=0.5), RewardSourceConfig(rule="task", weight=2.0)))
    rewards = RewardSet(cfg, _load, None, ArithmeticTask(), CPU)
    episodes = [EpisodeRecord("done", 2, [0.25, 0.5], 1.0), EpisodeRecord("max_turns", 1, [], 0.0)]
    responses = [Response("2+3=", "5", (1, 2), {"prompt": "2+3="}, episode=episodes[0]),
                 Response("2+3=", "7", (1, 2), {"prompt": "2+3="}, episode=episodes[1])]
    total, parts = rewards.score(responses)
    assert list(parts) == ["env", "rule_task"]
    assert parts["env"].tolist() == [1.75, 0.0] and parts["rule_task"].tolist() == [1.0, 0.0]
    assert total.tolist() == [0.5 * 1.75 + 2.0, 0.0]
    with pytest.raises(ValueError, match=r"reward.sources\[0\].env: responses \[0\] are not multi-turn trajectories"):
        rewards.score([Response("2+3=", "5", (1, 2), {"prompt": "2+3="})])
