"""A step-time model of PPO: each phase's seconds from its work (FLOPs, bytes) and the hardware,
with efficiencies fitted from measured phase costs. Used to predict shapes no one has run here.

Per step, for `samples` sequences of `prompt` + `response` tokens, 2 bytes per parameter (bf16):

- generate, separate vLLM engines (`distributed`): each of `engines` engines (TP `tp`) decodes
  samples/engines rows; one decode step reads the engine's weights once plus every row's KV cache
  (memory-bound) or does 2 x params x rows FLOPs (compute-bound), whichever is slower:
      response x max((2P + rows x KV) / (tp x HBM x decode_bw), 2P x rows / (tp x peak x forward_mfu))
      + prefill,   KV = KV bytes per token x mean context (prompt + response / 2)
- generate, ZeRO-3 HF generate by the training actor (`dschat-style`): every device decodes its
  own samples in batches of 16 (DSChat's per-device generation batch), and every decode step of
  every batch all-gathers the whole model from the other devices:
      batches x response x max(2P / (link x gather_bw), 2P / (HBM x decode_bw), compute) + prefill
- generate, `colocated`: as `distributed`, with the engines on the same devices as the roles.
- make_experience: forward passes of actor, reference, reward model and critic over every token,
  2 x params FLOPs per token at `forward_mfu` -- concurrently on each role's devices when the
  roles are separate, one after the other on all devices when they are not (colocated,
  dschat-style).
- train: actor and critic updates, 6 x params per token (8 with activation recomputation) at
  `train_mfu`, concurrent or sequential as above.
- weight_sync: the actor's bytes over the link at `sync_bw` (DSChat-style: none).

Assumptions (written down because they decide the prediction): attention FLOPs are left out of the
compute terms (small next to the weights at <= 2k tokens for >= 7B models; attention's KV-cache
*reads* are in the decode term, where they dominate at long contexts); phases run one after the
other (`step`), except in `step_overlapped`: the `distributed` layout with rollout.max_staleness 1,
max(generate, make_experience + train) + weight_sync; the ZeRO-3 all-gather uses the intra-node link (NVLink) at
`gather_bw` of its bandwidth; vLLM's KV cache holds every row of its share (no preemption).
Efficiencies fitted on one shape are assumed to hold at the others on the same hardware.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Literal

from hpcrlhf.bench.measure import PHASES


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float
    """Dense bf16 FLOP/s of one device."""
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    """Per-device bandwidth to the other devices of its node (one direction)."""


# Datasheet figures (NVIDIA A100/A800 and H100 SXM datasheets): A800 = A100 with NVLink cut to 400 GB/s.
A800_80GB = Hardware("A800-80GB", 312e12, 2.039e12, 200e9)
H100_SXM = Hardware("H100-SXM", 989e12, 3.35e12, 450e9)


@dataclass(frozen=True)
class Efficiency:
    train_mfu: float = 0.35
    forward_mfu: float = 0.45
    decode_bw: float = 0.6
    """Fraction of HBM bandwidth a decode step achieves."""
    gather_bw: float = 0.5
    """Fraction of the link bandwidth a ZeRO-3 all-gather achieves."""
    sync_bw: float = 0.5


@dataclass(frozen=True)
class Workload:
    params: float
    """Actor (= reference) parameters."""
    critic_params: float
    """Critic (= reward model) parameters."""
    prompt: int
    response: int
    samples: int
    kv_bytes_per_token: float = 0.0
    """KV-cache bytes per token of context (2 x layers x kv heads x head dim x 2 bytes)."""
    recompute: bool = True


@dataclass(frozen=True)
class SystemShape:
    """How a modelled system spreads one PPO step over its devices (not a node map: counts only)."""

    kind: Literal["distributed", "colocated", "dschat-style"]
    devices: int
    actor: int = 0
    critic: int = 0
    ref: int = 0
    reward: int = 0
    engines: int = 0
    tp: int = 1
    gen_batch: int = 16


def predict(w: Workload, lay: SystemShape, hw: Hardware, eff: Efficiency) -> dict[str, float]:
    """Seconds per phase of one PPO step (keys: measure.PHASES, plus `step`)."""
    bytes_actor = 2 * w.params
    tokens = w.samples * (w.prompt + w.response)
    train_factor = 8 if w.recompute else 6

    def fwd(params: float, devices: int) -> float:  # a role without devices (no critic: GRPO) costs nothing
        return 2 * params * tokens / (devices * hw.peak_flops * eff.forward_mfu) if devices else 0.0

    def train(params: float, devices: int) -> float:
        return train_factor * params * tokens / (devices * hw.peak_flops * eff.train_mfu) if devices else 0.0

    kv_row = w.kv_bytes_per_token * (w.prompt + w.response / 2)  # KV bytes a row reads per decode step
    if lay.kind in ("distributed", "colocated"):
        rows = w.samples / lay.engines
        step = max((bytes_actor + rows * kv_row) / (lay.tp * hw.hbm_bytes_per_s * eff.decode_bw),
                   2 * w.params * rows / (lay.tp * hw.peak_flops * eff.forward_mfu))
        prefill = 2 * w.params * rows * w.prompt / (lay.tp * hw.peak_flops * eff.forward_mfu)
        phases = {
            "generate": w.response * step + prefill,
            "make_experience": fwd(2 * w.params + 2 * w.critic_params, lay.devices) if lay.kind == "colocated" else max(fwd(w.params, lay.actor), fwd(w.params, lay.ref), fwd(w.critic_params, lay.critic),
                                   fwd(w.critic_params, lay.reward)),
            "train": (train(w.params + w.critic_params, lay.devices) if lay.kind == "colocated"
                      else max(train(w.params, lay.actor), train(w.critic_params, lay.critic))),
            "weight_sync": bytes_actor / (hw.link_bytes_per_s * eff.sync_bw),
        }
    else:
        batches = math.ceil(w.samples / lay.devices / lay.gen_batch)
        step = max(bytes_actor / (hw.link_bytes_per_s * eff.gather_bw),
                   (bytes_actor + lay.gen_batch * kv_row) / (hw.hbm_bytes_per_s * eff.decode_bw),
                   2 * w.params * lay.gen_batch / (hw.peak_flops * eff.forward_mfu))
        prefill = 2 * w.params * lay.gen_batch * w.prompt / (hw.peak_flops * eff.forward_mfu)
        phases = {
            "generate": batches * (w.response * step + prefill),
            "make_experience": fwd(2 * w.params + 2 * w.critic_params, lay.devices),
            "train": train(w.params + w.critic_params, lay.devices),
            "weight_sync": 0.0,
        }
    phases["other"] = 0.0
    phases["step"] = sum(phases[p] for p in PHASES)
    phases["step_overlapped"] = overlapped_step(phases) if lay.kind == "distributed" else phases["step"]
    return phases


def overlapped_step(phases: dict[str, float]) -> float:
    """One step of the overlapped schedule (rollout.max_staleness 1) on separate engine devices:
    the engines generate the next rollout while the roles make experience and train on this one,
    and the weights go in once both are done."""
    return max(phases["generate"], phases["make_experience"] + phases["train"]) + phases["weight_sync"] + phases["other"]


def fit(w: Workload, lay: SystemShape, hw: Hardware, measured: dict[str, float], start: Efficiency = Efficiency()) -> Efficiency:
    """The efficiencies that make `predict` reproduce `measured` phase seconds (phases absent from
    `measured` keep `start`'s value). Each phase's cost is inversely proportional to the efficiency
    that governs it, so one measurement fixes it: eff = start_eff x predicted / measured."""
    base = predict(w, lay, hw, start)
    out = start
    if "train" in measured:
        out = replace(out, train_mfu=start.train_mfu * base["train"] / measured["train"])
    if "make_experience" in measured and measured["make_experience"] > 0:
        out = replace(out, forward_mfu=start.forward_mfu * base["make_experience"] / measured["make_experience"])
    if "generate" in measured:
        # The governing term of generation: the ZeRO-3 gather (dschat-style) or the HBM read;
        # iterated because a max() may hand over to another term part-way.
        field = "gather_bw" if lay.kind == "dschat-style" else "decode_bw"
        for _ in range(50):
            probe = predict(w, lay, hw, out)["generate"]
            out = replace(out, **{field: getattr(out, field) * probe / measured["generate"]})
    return out


# OpenRLHF's published DeepSpeed-Chat runs (OpenRLHF/OpenRLHF benchmark/README.md): Llama2 actor and
# reward model of the same size, 8 x A800-80GB, 1024 prompts x (1024 + 1024) tokens per step, hybrid
# engine off, seconds per step of 1024 samples.
PUBLISHED_DSCHAT = {"7b": {"generate": 697.12, "train": 492.01, "step": 1189.13},
                    "13b": {"generate": 2590.72, "train": 1218.76, "step": 3809.36}}
LLAMA2_PARAMS = {"7b": 6.74e9, "13b": 13.0e9, "70b": 69.0e9}
# 2 (K and V) x layers x KV heads x head dim x 2 bytes (Llama 2 configs: 32 x 4096, 40 x 5120, 80 x 8 x 128).
LLAMA2_KV_BYTES = {"7b": 2 * 32 * 4096 * 2, "13b": 2 * 40 * 5120 * 2, "70b": 2 * 80 * 8 * 128 * 2}

# The shipped layouts (hpcrlhf/recipes/ppo-*.yaml) and the dschat-style baseline on the same GPUs.
# (The colocated layouts are the gpu-* suites' hpcrlhf-colocated: every GPU in an engine of TP tp.)
PAPER_LAYOUTS = {
    "7b": {"distributed": SystemShape("distributed", 16, actor=4, critic=4, ref=2, reward=2, engines=4, tp=1),
           "colocated": SystemShape("colocated", 16, engines=8, tp=2), "dschat-style": SystemShape("dschat-style", 16)},
    "13b": {"distributed": SystemShape("distributed", 32, actor=8, critic=8, ref=4, reward=4, engines=4, tp=2),
            "colocated": SystemShape("colocated", 32, engines=8, tp=4), "dschat-style": SystemShape("dschat-style", 32)},
    "70b": {"distributed": SystemShape("distributed", 32, actor=8, critic=8, ref=8, reward=8, engines=4, tp=4),
            "colocated": SystemShape("colocated", 32, engines=4, tp=8), "dschat-style": SystemShape("dschat-style", 32)},
}


def paper_predictions(hw: Hardware = A800_80GB) -> dict:
    """Fit the DSChat-side efficiencies on the published 7B phase costs, check them on the published
    13B run, and predict every shipped layout against DSChat-style on `hw`."""
    def workload(size: str, samples: int = 1024) -> Workload:
        return Workload(LLAMA2_PARAMS[size], LLAMA2_PARAMS[size], 1024, 1024, samples, LLAMA2_KV_BYTES[size])

    eight = SystemShape("dschat-style", 8)
    eff = fit(workload("7b"), eight, hw, {k: v for k, v in PUBLISHED_DSCHAT["7b"].items() if k != "step"})
    check = predict(workload("13b"), eight, hw, eff)
    out = {"hardware": asdict(hw), "efficiency": asdict(eff), "fitted_on": "published DSChat Llama2-7B, 8 x A800",
           "check_13b": {p: {"predicted": check[p], "published": PUBLISHED_DSCHAT["13b"][p],
                             "error": check[p] / PUBLISHED_DSCHAT["13b"][p] - 1} for p in ("generate", "train")},
           "shapes": {}}
    for size, layouts in PAPER_LAYOUTS.items():
        w = workload(size)
        steps = {name: predict(w, lay, hw, eff) for name, lay in layouts.items()}
        base = steps["dschat-style"]["step"]
        out["shapes"][size] = {"devices": layouts["dschat-style"].devices, "phases_s": steps,
                               "speedup_vs_dschat_style": {n: base / p["step"] for n, p in steps.items()},
                               "speedup_vs_dschat_style_overlapped": {n: base / p["step_overlapped"]
                                                                      for n, p in steps.items()},
                               "generation_share": {n: p["generate"] / p["step"] for n, p in steps.items()}}
    return out


def as_dict(eff: Efficiency) -> dict[str, float]:
    return asdict(eff)

