"""Sleep between phases: the moves that enter each phase, checked against what each phase may hold
(`placement.memory.phase_parts`, the plan's memory check) at every move, and the switch's memory."""

from __future__ import annotations

import itertools
from contextlib import nullcontext

import pytest

from hpcrlhf.placement.memory import PHASES, MemoryParts, phase_parts
from hpcrlhf.trainers.ppo.phases import PhaseSwitch, swap_actions

ENGINE = MemoryParts(weights=3, kv_cache=7)
TRAINED = MemoryParts(weights=1, gradients=1, optimizer=6)  # activations come and go inside `train`


def held(state: dict[str, set[str]]) -> int:
    """Bytes on the GPU of an engine and two trained roles, given what of each is awake."""
    engine = (ENGINE.weights if "weights" in state["engines"] else 0) + (ENGINE.kv_cache if "kv_cache" in state["engines"] else 0)
    return engine + sum(TRAINED.total for role in ("actor", "critic") if state[role])


def apply(state: dict[str, set[str]], who: str, verb: str, tags: tuple[str, ...]) -> None:
    if who == "engines":
        state[who] = set() if verb == "sleep" else state[who] | set(tags)
    else:
        state[who] = set() if verb == "sleep" else {"all"}


def phase_total(phase: str) -> int:
    """What the plan's check allows in `phase`: every occupant asleep where it may be."""
    parts = [phase_parts(ENGINE, kind="engine", sleeps=True, phase=phase)]
    parts += [phase_parts(TRAINED, kind="trained", sleeps=True, phase=phase)] * 2
    return sum(p.total for p in parts)


@pytest.mark.parametrize("start, target", list(itertools.product(PHASES, PHASES)))
def test_no_move_holds_more_than_the_phases_it_moves_between(start, target):
    roles = ("actor", "critic")
    state = {"engines": set(), "actor": set(), "critic": set()}
    for move in swap_actions(start, engines=True, roles=roles):  # settle in `start` from everything asleep
        apply(state, *move)
    assert held(state) == phase_total(start)
    for move in swap_actions(target, engines=True, roles=roles):
        apply(state, *move)
        assert held(state) <= max(phase_total(start), phase_total(target)), (start, target, move, state)
    assert held(state) == phase_total(target)  # and it holds exactly what the phase needs


def test_the_weight_sync_wakes_the_engine_weights_only_after_the_roles():
    assert swap_actions("weight_sync", engines=True, roles=("actor",)) == [
        ("engines", "sleep", ()), ("actor", "wake", ()), ("engines", "wake", ("weights",))]
    assert swap_actions("generate", engines=False, roles=("actor",)) == [("actor", "sleep", ())]
    assert swap_actions("train", engines=True, roles=()) == [("engines", "sleep", ())]
    with pytest.raises(ValueError, match="unknown phase 'rollout'"):
        swap_actions("rollout", engines=True, roles=())


def test_the_switch_moves_once_per_change_and_not_at_all_without_sleepers():
    moves, timed = [], []

    def timer():
        timed.append(1)
        return nullcontext()

    switch = PhaseSwitch(engines=True, roles=("actor",), act=lambda *m: moves.append(m), timed=timer)
    for phase in ("weight_sync", "generate", "generate", "train", "train", "weight_sync", "generate"):
        switch.enter(phase)
    assert len(timed) == 5 and switch.phase == "generate" and switch.sleepers == ("engines", "actor")
    assert moves[3:5] == [("actor", "sleep", ()), ("engines", "wake", ("weights", "kv_cache"))]
    idle = PhaseSwitch(engines=False, roles=(), act=lambda *m: moves.append(m), timed=timer)
    idle.enter("train")
    assert idle.phase == "train" and len(timed) == 5 and idle.sleepers == ()
