"""The agent scheduling benchmark's parts (`hpcrlhf.bench.agent_schedule`), without its vLLM runs (the
schedules themselves are tested in tests/agents/test_scheduler.py and, on vLLM, in
tests/engines/test_rollout.py): the environment's latencies and turns, the output layer calibrated
to a mean turn length, the plots and the command's errors."""

from __future__ import annotations

import json
import random
import statistics

import pytest
import torch

from hpcrlhf.bench import agent_schedule as bench
from hpcrlhf.models.loading import load_causal_lm, load_tokenizer


def test_latencies_are_log_normal_around_the_median_and_clipped():
    rng = random.Random(0)
    draws = [bench.latency(rng, 0.1, 1.5, 0.01, 2.0) for _ in range(20000)]
    assert min(draws) == 0.01 and max(draws) == 2.0  # both clips reached by a long tail
    assert statistics.median(draws) == pytest.approx(0.1, rel=0.05)
    # P(x > 2 s) = P(z > ln(20) / 1.5 = 1.997) = 2.3 %: the tail the turn barrier waits for
    assert sum(d == 2.0 for d in draws) / len(draws) == pytest.approx(0.0229, abs=0.004)


def test_the_environment_draws_its_turns_and_waits_from_the_seed_and_row(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(bench.time, "sleep", waits.append)

    def episode(row: int, seed: int) -> tuple[int, list[float]]:
        waits.clear()
        env, turns = bench.LongTail(max_turns=4), 0
        env.reset({"id": row}, seed)
        while not env.step("x" * 5).done:
            turns += 1
        return turns + 1, list(waits)

    assert episode(3, 7) == episode(3, 7)  # a rerun waits alike
    runs = [episode(row, 7) for row in range(200)]
    assert {turns for turns, _ in runs} == {1, 2, 3, 4}
    assert all(len(w) == turns for turns, w in runs)  # one wait per step


def test_the_calibrated_output_layer_ends_turns_after_the_asked_tokens_on_average(tiny_llama, tmp_path):
    tokenizer = load_tokenizer(tiny_llama)
    folder = bench.eos_calibrated(tiny_llama, tokenizer, True, 8.0, tmp_path / "model")
    model = load_causal_lm(folder)
    head = model.get_output_embeddings().weight
    assert head.abs().sum(1).nonzero().flatten().tolist() == [tokenizer.eos_token_id]  # other tokens uniform
    from hpcrlhf.agents.render import ChatRenderer

    prompt = torch.tensor([ChatRenderer(tokenizer).prompt(bench.first_messages(1)[0])])
    torch.manual_seed(0)
    out = model.generate(prompt.repeat(200, 1), do_sample=True, max_new_tokens=64, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.eos_token_id)[:, prompt.shape[1]:]
    ended = (out == tokenizer.eos_token_id).int()
    lengths = torch.where(ended.any(1), ended.argmax(1) + 1, torch.full((200,), 64)).float()
    # geometric with p = 1/8: mean 8 (the calibration is on other random contexts: within 25 %)
    assert 6 < lengths.mean().item() < 10, lengths.mean()


def fake_result(median_s: float, ratio: float) -> dict:
    turn = {"trajectories_per_s": 10.0, "engine_idle_share": 0.5}
    return {"model": "builtin:tiny-llama", "trajectories": 8, "max_turns": 3, "turn_tokens": 8.0, "device": "cpu",
            "latency": {"median_s": median_s, "sigma": 1.5, "min_s": 0.01, "max_s": 2.0}, "trajectory_over_turn": ratio,
            "turn": turn, "trajectory": {"trajectories_per_s": 10.0 * ratio, "engine_idle_share": 0.1}}


def test_the_plots_and_the_combined_settings(tmp_path):
    for i, median in enumerate((0.1, 0.02)):
        folder = tmp_path / f"run{i}"
        folder.mkdir()
        result = fake_result(median, 1.5 - i)
        (folder / "agent_schedule.json").write_text(json.dumps(result))
        bench.plot(result, folder / "agent_schedule.png")
        assert (folder / "agent_schedule.png").stat().st_size > 0
    bench.main(["-o", str(tmp_path / "all"), "--combine", str(tmp_path / "run0"), str(tmp_path / "run1")])
    assert (tmp_path / "all" / "agent_schedule_settings.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["--combine", "nowhere"], "--combine: no agent_schedule.json in nowhere"),
    (["--trajectories", "0"], "--trajectories must be at least 1, got 0"),
    (["--latency-min", "0.5", "--latency-median", "0.1"], "need 0 <= --latency-min (0.5) <= --latency-median (0.1)"),
])
def test_bad_arguments_are_named_before_anything_runs(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["-o", str(tmp_path / "out"), *args])
    assert message in capsys.readouterr().err
