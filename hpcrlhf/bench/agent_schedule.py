"""Agent scheduling benchmark: each trajectory on its own clock vs turn by turn, on one vLLM engine.

`python -m hpcrlhf.bench.agent_schedule -o DIR` runs the same batch of multi-turn trajectories on
one vLLM engine under both of `agent.schedule`'s values, alternating, `--repeats` times each:

- trajectory: a trajectory's next turn re-enters the engine the moment its environment answered,
  while the engine keeps generating for the others (hpcrlhf's default on vLLM);
- turn: after each round of model turns, every trajectory waits until every environment of the
  round answered (the turn-synchronous baseline: one barrier per turn).

The environment (`LongTail`, below) answers each turn after a latency drawn from a long-tailed
distribution (log-normal, clipped to `--latency-min`..`--latency-max` seconds: most steps are quick,
a few take seconds, as a code runner's or a web tool's do) and ends the trajectory after 1 to
`--turns` turns, both drawn from the trajectory's seed. Every sampled token is seeded by (run seed,
trajectory, turn), so both schedules must produce the same trajectories token for token: the
benchmark checks it on every repeat, so the comparison is of the same work.

The model's turns are uneven too: its output layer is replaced so that it writes uniformly random
tokens and ends a turn (EOS) with a probability calibrated to `--turn-tokens` tokens on average, a
geometric spread of lengths (a turn reaching `--max-new-tokens` ends its trajectory, truncated).

Writes `agent_schedule.json` (every repeat's seconds, trajectories/s, model tokens/s, the engine's
idle share while environments ran; medians; the ratio) and `agent_schedule.png`. The model is a
`builtin:llama-<N>m` built from config (random weights: what it writes does not matter here, only
how long it takes), or any `--model` path, saved with that output layer under DIR/model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from hpcrlhf.agents.contract import Step
from hpcrlhf.agents.render import ChatRenderer
from hpcrlhf.agents.runner import AgentRunner
from hpcrlhf.config.schema.agent import AgentConfig
from hpcrlhf.engines.rollout import SamplingParams
from hpcrlhf.engines.rollout.vllm import VLLMRollout
from hpcrlhf.logs import get_logger
from hpcrlhf.models.loading import load_causal_lm, load_tokenizer
from hpcrlhf.models.tiny import resolve_model_path
from hpcrlhf.plots import figure

log = get_logger()

SCHEDULES = ("trajectory", "turn")
COLORS = ("#1f77b4", "#999999")


class LongTail:
    """An environment whose steps take long-tailed times: each turn's latency is log-normal (median
    `median_s`, shape `sigma`) clipped to [min_s, max_s]; the trajectory ends after 1..max_turns turns
    (uniform). All of it is drawn from the trajectory's seed and row, so a rerun waits alike."""

    def __init__(self, median_s: float = 0.1, sigma: float = 1.5, min_s: float = 0.01, max_s: float = 2.0,
                 max_turns: int = 4) -> None:
        self.median_s, self.sigma, self.min_s, self.max_s, self.max_turns = median_s, sigma, min_s, max_s, max_turns

    def reset(self, row, seed):
        self.rng = random.Random(f"{seed}-{row['id']}")
        self.turns, self.judged = self.rng.randint(1, self.max_turns), 0
        return f"Task {row['id']}: write whatever you like, then wait for my answer."

    def step(self, action):
        time.sleep(latency(self.rng, self.median_s, self.sigma, self.min_s, self.max_s))
        self.judged += 1
        if self.judged >= self.turns:
            return Step(None, 0.0, True, {"success": True})
        return Step(f"Noted ({len(action)} characters). Go on.", 0.0)


def latency(rng: random.Random, median_s: float, sigma: float, min_s: float, max_s: float) -> float:
    """One step's seconds: log-normal with median `median_s` and shape `sigma`, clipped."""
    return min(max_s, max(min_s, median_s * math.exp(sigma * rng.gauss(0.0, 1.0))))


def first_messages(n: int = 16) -> list[list[dict]]:
    env = LongTail()
    return [[{"role": "user", "content": env.reset({"id": i}, 0)}] for i in range(n)]


def eos_calibrated(folder: str, tokenizer, chat: bool, turn_tokens: float, out: Path) -> str:
    """`folder`'s model with an output layer that draws every token but EOS uniformly and EOS with
    probability ~1/turn_tokens per token (over the hidden states of random turns after the first
    messages), saved in `out`."""
    model = load_causal_lm(folder, attn_implementation="sdpa")
    renderer = ChatRenderer(tokenizer, chat=chat)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)  # contexts as the turns will be: a prompt, then random tokens
        contexts = [torch.cat([torch.tensor(renderer.prompt(m)),
                               torch.randint(model.config.vocab_size, (int(4 * turn_tokens),), generator=g)])
                    for m in first_messages()]
        hidden = torch.cat([model.model(input_ids=c[None]).last_hidden_state[0, -int(4 * turn_tokens):]
                            for c in contexts])
        direction = hidden.mean(0) / hidden.mean(0).norm()
        x = (hidden @ direction).double()  # the EOS logit per unit of scale; every other logit is 0
        others = model.config.vocab_size - 1
        low, high = -50.0, 50.0  # mean P(EOS) = mean(1 / (1 + others * exp(-t x))) rises with t (x > 0 mostly)
        for _ in range(100):
            t = (low + high) / 2
            p = (1 / (1 + others * torch.exp(-t * x))).mean().item()
            low, high = (t, high) if p < 1 / turn_tokens else (low, t)
        head = model.get_output_embeddings().weight
        head.zero_()
        head[tokenizer.eos_token_id] = t * direction
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log.info(f"output layer: EOS with probability ~1/{turn_tokens:g} per token (scale {t:.3g}), other tokens uniform")
    return str(out)


def run(out: Path, *, model: str, trajectories: int, turns: int, turn_tokens: float, max_new_tokens: int,
        repeats: int, latency_args: dict[str, float], kv_cache_gb: float, seed: int = 0) -> dict:

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(resolve_model_path(model))
    chat = bool(getattr(tokenizer, "chat_template", None))
    folder = eos_calibrated(resolve_model_path(model), tokenizer, chat, turn_tokens, out / "model")
    max_tokens = 64 + turns * (max_new_tokens + 32)  # the prompt, each turn's answer and the environment's reply
    agent = AgentConfig(environment=f"{__name__}:LongTail", environment_args={**latency_args, "max_turns": turns},
                        max_turns=turns, max_tokens=max_tokens, env_workers=trajectories, step_timeout_s=60.0,
                        max_failed_share=0.0)
    runners = {s: AgentRunner(dataclasses.replace(agent, schedule=s), tokenizer, chat=chat) for s in SCHEDULES}
    # the calibration's model loading may touch CUDA in this process: an engine core forked from it then
    # fails or hangs at its device's start (seen on an H200); spawned, it starts clean
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    engine = VLLMRollout(folder, seed=seed, max_model_len=max_tokens + 16, kv_cache_bytes=int(kv_cache_gb * 2**30),
                         dtype=_dtype())
    rows = [{"id": i} for i in range(trajectories)]
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, seed=seed)
    runs: dict[str, list[dict]] = {s: [] for s in SCHEDULES}
    try:
        runners["trajectory"].run(engine, rows[: min(8, trajectories)], params, env_seed=seed + 1)  # warm-up
        for i in range(2 * repeats):
            schedule = SCHEDULES[i % 2] if (i // 2) % 2 == 0 else SCHEDULES[1 - i % 2]  # ABBA: drift cancels
            began = time.perf_counter()
            generations, stats = runners[schedule].run(engine, rows, params, env_seed=seed)
            wall = time.perf_counter() - began
            flat = [g for group in generations for g in group]
            runs[schedule].append(_figures(flat, stats, wall))
            log.info(f"{schedule}: {wall:.2f} s, {runs[schedule][-1]['trajectories_per_s']:.1f} trajectories/s, "
                     f"engine idle {runs[schedule][-1]['engine_idle_share']:.0%}")
            tokens = [g.response_ids for g in flat]
            if i == 0:
                reference = tokens
            elif tokens != reference:
                raise RuntimeError(f"repeat {i} ({schedule}): the trajectories differ from the first repeat's; "
                                   "the schedules must sample the same tokens (seeded per trajectory and turn)")
    finally:
        engine.close()
        for r in runners.values():
            r.close()
    result = {"command": " ".join(["python -m hpcrlhf.bench.agent_schedule", *sys.argv[1:]]), "model": model,
              "trajectories": trajectories, "max_turns": turns, "turn_tokens": turn_tokens,
              "max_new_tokens": max_new_tokens,
              "latency": latency_args, "repeats": repeats, "host": platform.node(), "device": _device_name(),
              "runs": runs}
    for s in SCHEDULES:
        result[s] = {k: statistics.median(r[k] for r in runs[s]) for k in runs[s][0]}
    result["trajectory_over_turn"] = result["trajectory"]["trajectories_per_s"] / result["turn"]["trajectories_per_s"]
    (out / "agent_schedule.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "agent_schedule.png")
    return result


def _figures(flat: list, stats, wall: float) -> dict:
    model_tokens = sum(sum(g.action_mask) for g in flat)
    turns = [g.episode.turns for g in flat]
    return {"wall_s": wall, "trajectories_per_s": len(flat) / wall, "model_tokens_per_s": model_tokens / wall,
            "engine_idle_share": stats.engine_idle_s / wall, "env_calls": stats.env_calls,
            "turns_mean": sum(turns) / len(turns), "model_tokens_per_turn": model_tokens / max(1, sum(turns)),
            "truncated_share": sum(g.episode.status == "max_tokens" for g in flat) / len(flat),
            "env_seconds": sum(g.episode.env_seconds for g in flat)}


def _dtype() -> str:
    from vllm.platforms import current_platform

    return "float32" if current_platform.is_cpu() else "bfloat16"


def _device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else (platform.processor() or platform.machine())


def plot(result: dict, path: Path) -> None:
    with figure(path, 2, (8, 3.2)) as (fig, axes):
        for ax, key, label in ((axes[0], "trajectories_per_s", "trajectories / s (median)"),
                               (axes[1], "engine_idle_share", "engine idle share (median)")):
            values = [result[s][key] for s in SCHEDULES]
            ax.bar(SCHEDULES, values, color=COLORS)
            for i, v in enumerate(values):
                ax.text(i, v, f"{v:.0%}" if key == "engine_idle_share" else f"{v:.2f}", ha="center", va="bottom",
                        fontsize=8)
            ax.set_ylabel(label)
            ax.margins(y=0.2)
        lat = result["latency"]
        fig.suptitle(f"{result['trajectories']} trajectories of 1-{result['max_turns']} turns, environment "
                     f"{lat['min_s']:g}-{lat['max_s']:g} s (median {lat['median_s']:g} s): "
                     f"{result['trajectory_over_turn']:.2f}x", fontsize=9)


def plot_settings(results: list[dict], path: Path) -> None:
    """Several runs' figures side by side, one group of bars per environment latency (`--combine`)."""
    results = sorted(results, key=lambda r: r["latency"]["median_s"])
    width = 0.38
    with figure(path, 1, (7, 3.4)) as (_, (ax,)):
        for k, (s, color) in enumerate(zip(SCHEDULES, COLORS)):
            xs = [i + (k - 0.5) * width for i in range(len(results))]
            values = [r[s]["trajectories_per_s"] for r in results]
            ax.bar(xs, values, width, color=color, label=s)
            for x, r, v in zip(xs, results, values):
                ax.text(x, v, f"idle {r[s]['engine_idle_share']:.0%}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels([f"{r['latency']['min_s']:g}-{r['latency']['max_s']:g} s, median "
                            f"{r['latency']['median_s']:g}\n{r['trajectory_over_turn']:.2f}x" for r in results],
                           fontsize=8)
        ax.set_ylabel("trajectories / s (median)")
        ax.set_xlabel("environment step latency (log-normal, clipped); trajectory over turn")
        first = results[0]
        ax.set_title(f"{first['model']}, {first['trajectories']} trajectories of 1-{first['max_turns']} turns, "
                     f"~{first['turn_tokens']:g} tokens per turn, on {first['device']}", fontsize=9)
        ax.legend(fontsize=8)
        ax.margins(y=0.2)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hpcrlhf.bench.agent_schedule", description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--combine", type=Path, nargs="+", metavar="DIR",
                   help="draw these runs' agent_schedule.json side by side into OUTPUT/agent_schedule_settings.png "
                        "(runs nothing)")
    p.add_argument("--model", default="builtin:llama-20m", help="a model folder or builtin:llama-<N>m (default 20m)")
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--turns", type=int, default=4, help="each trajectory runs 1..TURNS turns (default 4)")
    p.add_argument("--turn-tokens", type=float, default=16, help="tokens per model turn on average (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest model turn (default 64)")
    p.add_argument("--latency-median", type=float, default=0.1, help="environment step seconds, median (0.1)")
    p.add_argument("--latency-sigma", type=float, default=1.5, help="log-normal shape (1.5: a long tail)")
    p.add_argument("--latency-min", type=float, default=0.01)
    p.add_argument("--latency-max", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    args = p.parse_args(argv)
    if args.combine:
        missing = [str(d) for d in args.combine if not (d / "agent_schedule.json").is_file()]
        if missing:
            p.error(f"--combine: no agent_schedule.json in {', '.join(missing)}")
        args.output.mkdir(parents=True, exist_ok=True)
        plot_settings([json.loads((d / "agent_schedule.json").read_text()) for d in args.combine],
                      args.output / "agent_schedule_settings.png")
        return
    for name in ("trajectories", "turns", "turn_tokens", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.latency_min <= args.latency_median <= args.latency_max:
        p.error(f"need 0 <= --latency-min ({args.latency_min:g}) <= --latency-median ({args.latency_median:g}) "
                f"<= --latency-max ({args.latency_max:g})")
    latency_args = {"median_s": args.latency_median, "sigma": args.latency_sigma, "min_s": args.latency_min,
                    "max_s": args.latency_max}
    result = run(args.output, model=args.model, trajectories=args.trajectories, turns=args.turns,
                 turn_tokens=args.turn_tokens, max_new_tokens=args.max_new_tokens, repeats=args.repeats, latency_args=latency_args,
                 kv_cache_gb=args.kv_cache_gb)
    print(json.dumps({k: result[k] for k in ("trajectories", "trajectory", "turn", "trajectory_over_turn")}))


if __name__ == "__main__":
    main()
