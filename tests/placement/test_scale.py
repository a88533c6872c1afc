"""Planning costs what the nodes used cost, not the allocation's size: idle nodes are counted, never
enumerated, and counts past any real cluster are refused with the limit."""

from __future__ import annotations

import json
import sys

import pytest

from hpcrlhf.cli import main
from hpcrlhf.placement import render_text
from hpcrlhf.placement.layout import MAX_GPUS_PER_NODE, MAX_NODES, Device, FreeGPUs, assign

from .helpers import find, plan, problems

pytestmark = pytest.mark.timeout(60)  # before the fix these took minutes (or tens of GB) to plan


def test_a_large_allocation_lists_only_the_nodes_the_map_uses():
    m = plan("ppo-7b", "placement.allow_idle_gpus=true", nodes=MAX_NODES, gpus=8)
    assert len(m.devices) == 2 * 8 and m.idle_nodes == MAX_NODES - 2
    text = render_text(m)
    assert "\nnode 1\n" in text and "\nnodes 2-99999: idle (8 GPUs each)\n" in text and len(text.splitlines()) < 40
    assert json.loads(m.to_json())["idle_nodes"] == MAX_NODES - 2


def test_idle_nodes_are_named_as_one_range_with_the_fix():
    found = problems("ppo-7b", nodes=2000, gpus=8)
    find(found, "placement = 2000 nodes x 8 GPUs", "15,984 of 16,000 GPUs would idle (nodes 2-1999 gpus 0-7)",
         "ask for 2 nodes (--nodes 2)", "placement.vllm.engines=1024")


def test_idle_gpus_on_used_nodes_and_whole_idle_nodes_are_both_named():
    found = problems("ppo-7b", "placement.vllm.engines=2", nodes=4, gpus=8)
    find(found, "placement = 4 nodes x 8 GPUs", "18 of 32 GPUs would idle (node 1 gpus 6-7, nodes 2-3 gpus 0-7)")


@pytest.mark.parametrize("option, value, limit", [("--nodes", 100_000_000, f"{MAX_NODES:,}"),
                                                  ("--gpus-per-node", 1000, f"{MAX_GPUS_PER_NODE}")])
def test_counts_past_any_cluster_are_refused_with_the_limit(option, value, limit, capsys):
    assert main(["plan", "ppo-7b", option, str(value)]) == 2
    err = capsys.readouterr().err
    key = "placement.nodes" if option == "--nodes" else "placement.gpus_per_node"
    assert f"{key} = {value}: more " in err and f"(at most {limit})" in err and f"fix: use at most {limit}" in err


def test_an_absurd_engine_count_is_a_problem_not_a_long_search():
    found = problems("ppo-7b", "placement.vllm.engines=1000000000")
    find(found, "placement.vllm.engines = 1000000000", "do not split evenly over 1000000000 engines",
         "use 1, 2, 4, 8, 16, 32, 64, 128, 256, 512 or 1024 engines")


def _calls_to_place(nodes: int) -> int:
    """Function calls (Python and builtin) made to place ppo-7b's roles on `nodes` x 8 GPUs and give every
    GPU they leave to a TP-1 vLLM engine: the placement's work, counted, not timed."""
    shapes = {"actor": (1, 4), "critic": (1, 4), "ref": (1, 2), "reward": (1, 2)}
    engines, problems, calls = nodes * 8 - 12, [], 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        layout = assign(nodes, 8, shapes, engines, 1, (), problems)
    finally:
        sys.setprofile(None)
    assert not problems and len(layout.engines) == engines and layout.used_nodes == nodes
    return calls


def test_placing_twice_the_engines_is_twice_the_work():
    # A first fit that rescanned every node for each engine did 3.9x the work here (and took 32 s in all to
    # plan 127,988 engines, over 120 s for 799,988; benchmarks/README.md)
    small, large = _calls_to_place(250), _calls_to_place(500)
    assert large < 2.1 * small, f"{large:,} calls for 3,988 engines vs {small:,} for 1,988: worse than linear"


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_first_fit_looks_at_each_node_a_bounded_number_of_times(tp):
    """E engines on N nodes look at about E + N nodes, however the roles before them left the nodes."""
    free = FreeGPUs(nodes=4000, gpus_per_node=8)
    assert free.take(3, 5) == [Device(n, g) for n in range(3) for g in range(5)]  # a role of 3 nodes x 5 GPUs
    engines = 0
    while (taken := free.take(1, tp)) is not None:
        assert len({d.node for d in taken}) == 1
        engines += 1
    assert engines == 3 * (3 // tp) + 3997 * (8 // tp)  # the role's nodes keep 3 free GPUs each
    assert len(free.nodes) == 4000 and not any(len(gpus) >= tp for gpus in free.nodes)
    assert free.looked <= 2 * (engines + len(free.nodes)), f"{free.looked:,} node looks for {engines:,} engines"


def test_the_cpu_work_of_every_node_is_one_pass_over_the_engines():
    """`hpcrlhf plan` shows each node's CPU work (rule servers, agent environment threads per engine): asking
    for every node's costs what one pass over servers and engines does, not nodes x engines."""
    from hpcrlhf.placement.layout import Device
    from hpcrlhf.placement.nodemap import NodeMap

    def calls(nodes: int) -> int:
        m = NodeMap(nodes, 8, 80 << 30, {}, None, {}, tuple((Device(n, g),) for n in range(nodes) for g in range(8)),
                    (), {}, env_workers=4)
        count = 0

        def counter(frame, event, arg):
            nonlocal count
            count += event in ("call", "c_call")

        sys.setprofile(counter)
        try:
            works = [m.cpu_work(n) for n in range(nodes)]
        finally:
            sys.setprofile(None)
        assert works[-1] == [("environments (8 engines x 4 threads)", 32)]
        return count

    small, large = calls(250), calls(500)
    assert large < 2.1 * small, f"{large:,} calls for 500 nodes vs {small:,} for 250: worse than linear"
