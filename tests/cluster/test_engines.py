"""vLLM engines as Ray actors on the node map's TP groups: each engine runs where the map says,
and after every weight sync its greedy generations equal those of the trainer's weights; a batch of
multi-turn trajectories split over them is the batch one engine runs."""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from hpcrlhf.config.jobspec import resolve_recipe
from hpcrlhf.config.loader import load_config
from hpcrlhf.cluster.worker_group import RoleWorker
from hpcrlhf.config.schema import PPOConfig
from hpcrlhf.engines import weight_sync
from hpcrlhf.engines.rollout import Generation, SamplingParams
from hpcrlhf.placement import build_node_map
from tests.engines.test_rollout import perturbed

pytestmark = pytest.mark.slow


def greedy_tokens(gens) -> list[list[int]]:
    return [s[0].response_ids for s in gens]


def weight_group(engines, tp: int):
    """A weight-sync group of this process (rank 0) and every worker of `engines`."""
    import ray

    store, at = weight_sync.serve_store("127.0.0.1")
    spec = weight_sync.SyncGroup(at, 1 + len(engines) * tp, "test-weights", timeout_s=120)
    joined = [e.join_weight_group.remote(spec, 1 + i * tp) for i, e in enumerate(engines)]
    group = weight_sync.join(spec, 0, store)
    assert ray.get(joined) == [[1 + i * tp + t for t in range(tp)] for i in range(len(engines))]  # each worker's rank
    return group


def vllm_children(engine) -> list[str]:
    """The names of the vLLM processes an engine actor started."""
    import ray

    def names(self) -> list[str]:
        import psutil

        return sorted(p.name() for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM"))

    return ray.get(engine.__ray_call__.remote(names))


def test_engines_on_tp_groups_follow_weight_syncs(ray_cluster, tiny_llama):
    """Both sync paths, alternated: the whole state dict through Ray's object store, and a
    broadcast in a weight-sync group of every engine worker (TP 2: each worker gets the full
    tensors and vLLM shards them)."""
    pytest.importorskip("vllm")
    import ray
    from transformers import AutoModelForCausalLM

    from hpcrlhf.cluster.engines import EngineWorker
    from hpcrlhf.cluster.reservation import reserve
    from hpcrlhf.cluster.worker_group import WorkerGroup
    from hpcrlhf.data.tasks import ArithmeticTask
    from hpcrlhf.engines.rollout.hf import HFRollout
    from hpcrlhf.models.loading import load_tokenizer

    node_map = build_node_map(load_config(PPOConfig, resolve_recipe("ppo-tiny-ray")))
    tokenizer = load_tokenizer(tiny_llama)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in ArithmeticTask().prompt_rows("eval", 12)]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    hf = HFRollout(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   device=torch.device("cpu"))
    params = SamplingParams(greedy=True, max_new_tokens=8)

    reservation = reserve(node_map)
    engines = None
    try:
        engines = WorkerGroup.for_engines(EngineWorker, reservation, tiny_llama, tensor_parallel_size=2,
                                          max_model_len=128, kv_cache_bytes=1 << 27)
        for where, devices in zip(engines.call("whereabouts"), node_map.engines):
            assert where.node_ip == ray_cluster.node_ips[devices[0].node]
            assert where.visible_devices == ",".join(str(d.gpu) for d in devices) == "2,3"
        # vLLM's CPU platform: the engine core runs in the actor, which starts only the TP workers
        assert [vllm_children(e) for e in engines.workers] == [["VLLM::Worker_TP0", "VLLM::Worker_TP1"]] * 2
        # each TP worker waits for work on a socket after 5 ms instead of spinning a second (CPU cores)
        spins = ray.get([e.__ray_call__.remote(lambda self: self.engine.llm.collective_rpc("hpcrlhf_reader_spins"))
                         for e in engines.workers])
        assert all(len(s) == 2 and all(w and set(w) == {0.005} for w in s) for s in spins), spins
        before = greedy_tokens(hf.generate(prompts, params))
        assert [greedy_tokens(g) for g in engines.call("generate", prompts, params)] == [before, before]
        group = None
        for update, path in enumerate(["object_store", "collective", "collective", "object_store"]):
            with torch.no_grad():  # an "optimizer step", then a sync by one path or the other
                gen = torch.Generator().manual_seed(update)
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            if path == "object_store":
                engines.call("load_weights", {k: v.clone() for k, v in model.state_dict().items()})
            else:  # this process is the group's rank 0 (as actor rank 0 is in a run), tiny buckets
                group = group or weight_group(engines.workers, tp=2)
                engines.call("pop_busy")
                receiving = engines.call_async("receive_weights")
                time.sleep(1.5)  # the engines wait in the group, as while the actor trains in a run
                start = time.monotonic()
                sent = weight_sync.WeightSender(group, 1 << 14).send(model.state_dict().items())
                assert ray.get(receiving) == [len(model.state_dict())] * 2 and sent.buckets > 4
                loading = time.monotonic() - start
                busy = engines.call("pop_busy")
                # busy loading the weights (from the first bucket on), not waiting for them
                assert all(0 < b <= loading for b in busy), (busy, loading)
            after = greedy_tokens(hf.generate(prompts, params))
            assert [greedy_tokens(g) for g in engines.call("generate", prompts, params)] == [after, after]
            assert after != before  # the update changed the greedy answers, so equality is evidence
            before = after
        # a batch over the fleet comes back group by group as the engines finish them (each once, in any
        # order), the groups in prompt order being the batch's result
        from hpcrlhf.cluster.engines import EngineFleet

        engines.call("pop_busy")
        batch = EngineFleet(engines, None).launch(prompts, SamplingParams(n=2, max_new_tokens=8, seed=3))
        items = list(batch.as_finished())
        assert sorted(i for item in items for i, _ in item) == list(range(len(prompts)))  # each prompt once
        assert batch.finished() is not None
        assert [gens for _, gens in sorted(g for item in items for g in item)] == batch.result()
        assert list(batch.as_finished()) == []  # taken once
        assert all(b > 0 for b in engines.call("pop_busy"))  # streaming counts as the engines' work
        check_episodes_over_the_fleet(engines, EngineFleet(engines, None), model, tokenizer, tiny_llama)
    finally:
        if engines is not None:
            engines.call("close")
            engines.kill()
        reservation.release()


def check_episodes_over_the_fleet(engines, fleet, model, tokenizer, tiny_llama) -> None:
    """Multi-turn trajectories (issue 39) split over the fleet's engines, each part beside its engine
    (its environments in the engine's actor), are the trajectories one engine runs for the whole
    batch: turn and environment seeds follow the rows' places in the batch. tests.agents.envs:Countdown
    judges 2 turns (0.1 each) and gives 1.0 at the end, on the model made to end its turns early."""
    import ray

    from hpcrlhf.agents.runner import AgentSpec
    from hpcrlhf.config.schema.agent import AgentConfig
    from tests.engines.test_rollout import agent_eos_prone

    engines.call("load_weights", agent_eos_prone(model, tokenizer))
    spec = AgentSpec(AgentConfig(environment="tests.agents.envs:Countdown", environment_args={"turns": 2}, max_turns=3,
                                 max_tokens=48), tiny_llama, True)
    rows = [{"prompt": f"count {i}", "id": f"row{i}"} for i in range(6)]
    origins = [f"rows.jsonl:{i + 1}" for i in range(6)]
    params = SamplingParams(n=2, max_new_tokens=8, seed=5)
    batch = fleet.launch_episodes(rows, params, origins, 11, spec)
    split, stats = batch.result(), batch.stats()
    stream = engines.workers[0].run_episodes_stream.options(num_returns="streaming").remote(rows, params, origins, 11,
                                                                                           spec)
    whole = ray.get(next(stream))
    assert [i for i, _ in whole] == list(range(6)) and sorted(batch.part_stats) == [0, 1]  # both engines ran a part

    def seen(groups) -> list:
        return [[(g.response_ids, g.action_mask, g.logprobs, g.episode.status, g.episode.reward) for g in group]
                for group in groups]

    assert seen(split) == seen([g for _, g in whole])
    records = [g.episode for group in split for g in group]
    assert any(r.turns == 2 and r.status == "done" and r.reward == pytest.approx(1.2) for r in records), records
    assert stats.env_calls == whole.stats.env_calls and stats.wall_s > 0  # the parts' figures added up


def test_an_engine_of_tp_1_runs_in_its_actor_and_follows_weight_syncs(ray_cluster, tiny_llama):
    """At TP 1 on vLLM's CPU platform the whole engine -- core and model -- runs in the actor's own
    process (no vLLM process started), and both sync paths reach the model there."""
    pytest.importorskip("vllm")
    import ray

    from hpcrlhf.cluster.engines import EngineWorker
    from hpcrlhf.engines.rollout.hf import HFRollout
    from hpcrlhf.models.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    model = load_causal_lm(tiny_llama, attn_implementation="sdpa").eval()
    hf = HFRollout(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, device="cpu")
    prompts = [tokenizer(t)["input_ids"] for t in ("12+34=", "7+8=", "99+1=", "5+55=")]
    params = SamplingParams(greedy=True, max_new_tokens=8)
    engine = ray.remote(EngineWorker).options(num_cpus=0).remote("vllm", 0, 1, tiny_llama, tensor_parallel_size=1,
                                                                 max_model_len=64, kv_cache_bytes=1 << 26)
    try:
        assert vllm_children(engine) == []
        before = greedy_tokens(hf.generate(prompts, params))
        assert greedy_tokens(ray.get(engine.generate.remote(prompts, params))) == before
        group = weight_group([engine], tp=1)
        for update, path in enumerate(["collective", "object_store"]):
            model.load_state_dict(perturbed(model.state_dict(), std=0.05, seed=update))
            if path == "object_store":
                ray.get(engine.load_weights.remote({k: v.clone() for k, v in model.state_dict().items()}))
            else:
                receiving = engine.receive_weights.remote()
                weight_sync.WeightSender(group, 1 << 14).send(model.state_dict().items())
                assert ray.get(receiving) == len(model.state_dict())
            after = greedy_tokens(hf.generate(prompts, params))
            assert greedy_tokens(ray.get(engine.generate.remote(prompts, params))) == after != before
            before = after
        ray.get(engine.close.remote())
    finally:
        ray.kill(engine)


def test_an_engine_loop_actor_pauses_its_batch_for_a_weight_sync_and_each_span_has_its_weights_logprobs(
        ray_cluster, tiny_llama):
    """rollout.partial on Ray (issue 40): an engine actor on an engine loop takes a weight sync while a batch is
    under way -- the samples pause, the weights load, they go on under them -- and each sample records where the
    version changed; every token's log-prob is that of its span's weights (the HF forward over the whole
    sequence). A batch launched before the sync starts under the old weights (the calls keep their order in the
    actor's default group; the batch streams in a group of its own, so the sync is not queued behind it). Agent
    trajectories run on the loop as well."""
    pytest.importorskip("vllm")
    import ray

    from hpcrlhf.cluster.engines import LOOP_ACTOR, STREAMS, EngineWorker
    from hpcrlhf.engines.rollout.contract import token_versions
    from hpcrlhf.models.loading import load_causal_lm, load_tokenizer
    from tests.engines.test_rollout import engine_tol, forward_logprobs

    tokenizer = load_tokenizer(tiny_llama)
    model = load_causal_lm(tiny_llama, attn_implementation="sdpa").eval()
    old = {k: v.clone() for k, v in model.state_dict().items()}
    new = perturbed(old, std=0.02, seed=5)
    prompts = [tokenizer(t)["input_ids"] for t in ("12+34=", "7+8=", "99+1=", "5+55=")]
    # prompt 0's group ends after 4 tokens: by then every other sample has 4 tokens of version 0 (they advance
    # together) and 196 to go, so the sync that follows comes mid-way whatever the host's load
    params = SamplingParams(n=2, max_new_tokens=200, seed=3, lengths=(4, 200, 200, 200))
    engine = ray.remote(**LOOP_ACTOR)(EngineWorker).options(num_cpus=0).remote(
        "vllm", 0, 1, tiny_llama, tensor_parallel_size=1, max_model_len=256, kv_cache_bytes=1 << 26, loop=True,
        partial=True)
    try:
        group = weight_group([engine], tp=1)
        launched = engine.launch.remote(prompts, params)
        stream = engine.stream_batch.options(num_returns="streaming", concurrency_group=STREAMS).remote(launched)
        first = ray.get(next(stream))
        assert [i for i, _ in first] == [0]
        receiving = engine.receive_weights.remote(1)  # behind the launch, beside the stream
        weight_sync.WeightSender(group, 1 << 14).send(new.items())
        assert ray.get(receiving) == len(new)
        groups = dict(first + [g for ref in stream for g in ray.get(ref)])
        assert sorted(groups) == [0, 1, 2, 3]
        spans = [g.versions for i in (1, 2, 3) for g in groups[i]]
        assert all(v[0] == (0, 0) and len(v) == 2 and 4 <= v[1][0] < 200 and v[1][1] == 1 for v in spans), spans
        assert [g.versions for g in groups[0]] == [[(0, 0)]] * 2
        models = {0: model, 1: load_causal_lm(tiny_llama, attn_implementation="sdpa").eval()}
        models[1].load_state_dict(new)
        with torch.no_grad():
            for gens in groups.values():
                for g in gens:
                    want = {v: forward_logprobs(m, g) for v, m in models.items()}
                    expected = torch.tensor([float(want[v][p]) for p, v in enumerate(token_versions(g))])
                    assert (expected - torch.tensor(g.logprobs)).abs().max() < engine_tol(), g.versions
        # a batch launched after the sync is all of the new version
        after = ray.get(engine.generate.remote(prompts[:1], SamplingParams(n=1, max_new_tokens=8, seed=1)))
        assert after[0][0].versions == [(0, 1)]
        # multi-turn trajectories on the loop (their turns posted to it; the call waits in STREAMS, beside the
        # default group): every span of the version the engine holds, each model token's log-prob the HF model's
        from hpcrlhf.agents.runner import AgentSpec
        from hpcrlhf.config.schema.agent import AgentConfig

        spec = AgentSpec(AgentConfig(environment="tests.agents.envs:Countdown", environment_args={"turns": 2},
                                     max_turns=3, max_tokens=48), tiny_llama, True)
        rows = [{"prompt": f"count {i}", "id": f"row{i}"} for i in range(3)]
        stream = engine.run_episodes_stream.options(num_returns="streaming", concurrency_group=STREAMS).remote(
            rows, SamplingParams(n=2, max_new_tokens=8, seed=5), [f"rows.jsonl:{i + 1}" for i in range(3)], 11, spec)
        trajectories = [g for _, group in ray.get(next(stream)) for g in group]
        assert len(trajectories) == 6 and all(g.episode is not None and any(g.action_mask) for g in trajectories)
        with torch.no_grad():
            for g in trajectories:
                assert g.versions == [(0, 1)]
                model_tokens = torch.tensor(g.action_mask, dtype=torch.bool)
                gap = (forward_logprobs(models[1], g) - torch.tensor(g.logprobs))[model_tokens]
                assert gap.abs().max() < engine_tol()
        assert ray.get(engine.pop_busy.remote()) > 0  # the loop's engine steps
        # arrival order's drop of a group of trajectories, by its name; a cancel that comes before its run (the calls
        # are in different groups) stops it at its start: no turn is generated, the environments still finish
        ray.get(engine.cancel_episodes.remote("group-7"))
        stream = engine.run_episodes_stream.options(num_returns="streaming", concurrency_group=STREAMS).remote(
            rows, SamplingParams(n=2, max_new_tokens=8, seed=5), [f"rows.jsonl:{i + 1}" for i in range(3)], 11, spec,
            "group-7")
        cut = [g for _, group in ray.get(next(stream)) for g in group]
        assert len(cut) == 6 and not any(g.response_ids for g in cut), [g.response_ids for g in cut]
        assert ray.get(engine.__ray_call__.remote(lambda self: len(self.episode_runs))) == 0  # nothing left behind
        # arrival order's drop of a group under way: `cancel` aborts it and its stream ends, short of its groups
        long = SamplingParams(n=2, max_new_tokens=200, min_new_tokens=200, seed=7)
        launched = engine.launch.remote(prompts[:1], long)
        stream = engine.stream_batch.options(num_returns="streaming", concurrency_group=STREAMS).remote(launched)
        ray.get(engine.cancel.remote(launched))
        assert [ray.get(ref) for ref in stream] == []
        assert ray.get(engine.generate.remote(prompts[:1], long))[0][0].versions == [(0, 1)]  # the loop goes on
        # a checkpoint that does not wait: `suspend` gives the batch as far as it got and lets it go on; `relaunch`
        # continues that state (in a resumed run's engine) and every sample ends whole, its prefix kept
        launched = engine.launch.remote(prompts[:2], long)
        stream = engine.stream_batch.options(num_returns="streaming", concurrency_group=STREAMS).remote(launched)
        for _ in range(100):  # (a pause for a checkpoint opens no span: looking again changes nothing)
            state = ray.get(engine.suspend.remote(launched))
            if all(s.tokens for _, _, s in state.under_way):
                break
            time.sleep(0.02)
        assert state.count == 2 and len(state.under_way) == 4 and all(0 < len(s.tokens) < 200
                                                                       for _, _, s in state.under_way)
        whole = dict(g for ref in stream for g in ray.get(ref))
        again = engine.stream_batch.options(num_returns="streaming", concurrency_group=STREAMS).remote(
            engine.relaunch.remote(state))
        resumed = dict(g for ref in again for g in ray.get(ref))
        assert sorted(resumed) == sorted(whole) == [0, 1]
        for i, j, sample in state.under_way:
            g = resumed[i][j]
            assert len(g.response_ids) == 200 and g.response_ids[:len(sample.tokens)] == sample.tokens
        assert ray.get(engine.suspend.remote(launched)) is None  # ended: its stream gave everything
        ray.get(engine.close.remote())
    finally:
        ray.kill(engine)


class StreamingStandIn(RoleWorker):
    """An engine stand-in streaming its prompts' groups one by one, each response [first prompt token,
    try]; engine 0's first try (while `marker` exists) dies after two groups."""

    def __init__(self, role: str, rank: int, world_size: int, marker: str) -> None:
        super().__init__(role, rank, world_size)
        self.dies = rank == 0 and os.path.exists(marker)
        if self.dies:
            os.unlink(marker)
        self.attempt = 1 if self.dies else 2

    def generate_stream(self, prompts, params):
        for i, prompt in enumerate(prompts):
            time.sleep(0.2)
            if self.dies and i == 2:
                os._exit(1)
            yield [(i, [Generation(list(prompt), [prompt[0], self.attempt], [0.0, 0.0], True)] * params.n)]


def test_a_batch_streams_its_groups_and_keeps_those_received_before_an_engine_died(ray_cluster, tmp_path):
    """Each engine's finished groups come back while it generates the rest; when one dies mid-part its
    part is redone on a restarted engine, the groups received before stay (what was scored is what
    is trained on) and their copies in the redo are dropped."""
    import ray

    from hpcrlhf.cluster.engines import EngineFleet
    from hpcrlhf.cluster.reservation import reserve
    from hpcrlhf.cluster.worker_group import WorkerGroup

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the class travels with its code
    marker = tmp_path / "first-try"
    marker.touch()
    reservation = reserve(build_node_map(load_config(PPOConfig, resolve_recipe("ppo-tiny-ray"))))
    try:
        engines = WorkerGroup.for_engines(StreamingStandIn, reservation, str(marker))
        pushed = []
        fleet = EngineFleet(engines, lambda handles, version: pushed.append(handles), max_restarts=1)
        prompts = [[p] for p in range(10)]
        batch = fleet.launch(prompts, SamplingParams(n=2))
        items = list(batch.as_finished())
        assert sorted(i for item in items for i, _ in item) == list(range(10))  # each prompt once
        assert len(items) >= 5 and batch.finished() is not None  # group by group, not part by part
        attempts = [gens[0].response_ids[1] for gens in batch.result()]
        assert [gens[0].response_ids[0] for gens in batch.result()] == list(range(10))
        assert attempts == [1, 1, 2, 2, 2] + [2] * 5, attempts  # engine 0: two groups kept, three redone
        assert [gens for _, gens in sorted(g for item in items for g in item)] == batch.result()
        assert len(pushed) == 1 and list(batch.as_finished()) == []  # the new engine got weights; taken once
        engines.kill()
    finally:
        reservation.release()


def test_one_prompt_batches_go_to_the_engine_with_the_fewest_under_way(monkeypatch):
    """Arrival order launches one group per batch: each goes to the engine with the fewest such groups under way
    (ended or cancelled ones no longer count; the lowest rank on a tie); a batch of several prompts is split over
    every engine as before. A group of trajectories (one row) goes alike, and is stopped by its name on its engine."""
    from hpcrlhf.cluster import engines

    stopped = []

    class Worker:  # an engine actor's handle: what `cancel` sends it
        def __init__(self, rank: int) -> None:
            self.cancel_episodes = SimpleNamespace(remote=lambda token: stopped.append((rank, token)))

    class Batch:
        def __init__(self, fleet, prompts, params, ranks=None, token=None, **how) -> None:
            self.parts = {rank: (0, 1) for rank in (ranks if ranks is not None else range(len(fleet.group)))}
            self.callbacks, self.cancelled, self.numbers, self.token, self.done_at = [], False, {}, token, {}
            self.sent_to = {rank: Worker(rank) for rank in self.parts}

        def add_done_callback(self, fn) -> None:
            self.callbacks.append(fn)

        def end(self) -> None:  # its stream ended: what Ray's callback thread runs
            for fn in self.callbacks:
                fn()

    monkeypatch.setattr(engines, "FleetBatch", Batch)
    fleet = engines.EngineFleet(["engine 0", "engine 1", "engine 2"], push=None, streaming=True)
    first = [fleet.launch([[1]], None) for _ in range(4)]
    assert [list(b.parts) for b in first] == [[0], [1], [2], [0]]
    first[1].end()
    fleet.cancel([first[2]])
    first[2].end()  # a cancelled batch's stream ends too: counted once
    assert fleet.single_load == {0: 2, 1: 0, 2: 0}  # engines 1 and 2 have none under way now
    assert [list(fleet.launch([[1]], None).parts) for _ in range(3)] == [[1], [2], [1]]
    assert list(fleet.launch([[1], [2]], None).parts) == [0, 1, 2]
    # a group of trajectories (one row) likewise, and its cancel stops it by its token on its engine
    monkeypatch.setattr(engines, "gather", list)
    episodes = [fleet.launch_episodes([{"prompt": "p"}], None, ["rows:1"], 0, None) for _ in range(2)]
    assert [list(b.parts) for b in episodes] == [[2], [0]] and episodes[0].token != episodes[1].token
    fleet.cancel([episodes[0]])
    assert stopped == [(2, episodes[0].token)] and fleet.single_load == {0: 3, 1: 2, 2: 1}
