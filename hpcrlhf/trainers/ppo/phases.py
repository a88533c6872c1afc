"""Sleep between phases (placement.vllm.sleep, placement.<role>.sleep): who holds GPU memory when.

A PPO step's roles take turns with the GPUs they share (`placement.memory.PHASES`):

    generate     the vLLM engines generate; sleeping trained roles hold nothing on the GPU
    train        the roles score and train; sleeping engines hold nothing
    weight_sync  the actor's weights go into the engines: the trained roles awake, the engines'
                 weights awake and their KV cache still asleep

`swap_actions` says what moves to enter a phase, frees before allocations, so a GPU never holds
more than the phase's memory `hpcrlhf plan` checked. `PhaseSwitch` remembers the phase and applies
the moves through the roles (local engines and DeepSpeed engines, or Ray workers). Sleeping and
waking are idempotent on each side, and no-ops where the states live in CPU memory anyway (CPU
runs): the switch itself runs the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.engines.rollout import ENGINE_MEMORY
from hpcrlhf.placement.memory import PHASES

Action = tuple[str, str, tuple[str, ...]]
"""(who: "engines" or a trained role, "sleep" or "wake", the engine memory tags to wake)."""


def swap_actions(phase: str, *, engines: bool, roles: Sequence[str]) -> list[Action]:
    """The moves that enter `phase` when the engines sleep (`engines`) and the trained `roles` do,
    in order: whatever the phase does not need is released before anything it needs is restored."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
    sleep_engines = [("engines", "sleep", ())] if engines else []
    if phase == "generate":
        return [(role, "sleep", ()) for role in roles] + ([("engines", "wake", ENGINE_MEMORY)] if engines else [])
    wake_roles = [(role, "wake", ()) for role in roles]
    if phase == "train":
        return sleep_engines + wake_roles
    return sleep_engines + wake_roles + ([("engines", "wake", ("weights",))] if engines else [])


class PhaseSwitch:
    """The current phase of a job whose roles sleep between phases; `enter(phase)` applies the
    moves (`act(who, verb, tags)`) under `timed()` (the metric timing/swap)."""

    def __init__(self, *, engines: bool, roles: Sequence[str], act: Callable[[str, str, tuple[str, ...]], None],
                 timed: Callable) -> None:
        self.engines, self.roles, self.act, self.timed = engines, tuple(roles), act, timed
        self.phase: str | None = None

    @classmethod
    def for_job(cls, cfg: PPOConfig, trained: Sequence[str], engines, move_role: Callable[[str, str], None],
                timed: Callable) -> PhaseSwitch:
        """The switch of a PPO job: its `engines` (`sleep()`, `wake(tags)`) sleep with
        placement.vllm.sleep, each of its `trained` roles (`move_role(role, "sleep" | "wake")`) with
        placement.<role>.sleep."""
        p = cfg.placement

        def act(who: str, verb: str, tags: tuple[str, ...]) -> None:
            if who != "engines":
                move_role(who, verb)
            elif verb == "sleep":
                engines.sleep()
            else:
                engines.wake(tags)

        return cls(engines=p.vllm.sleep, roles=[r for r in trained if getattr(p, r).sleep], act=act, timed=timed)

    @property
    def sleepers(self) -> tuple[str, ...]:
        """Who sleeps: "engines" and trained roles."""
        return ("engines",) * self.engines + self.roles

    def enter(self, phase: str) -> None:
        if phase == self.phase or not self.sleepers:
            self.phase = phase
            return
        with self.timed():
            for who, verb, tags in swap_actions(phase, engines=self.engines, roles=self.roles):
                self.act(who, verb, tags)
        self.phase = phase
