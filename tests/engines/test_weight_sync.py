"""Weight sync into a real vLLM engine for every model family hpcrlhf ships as a tiny model.

The trainer holds weights as transformers keeps them in memory; vLLM loads checkpoint names and
layouts. The two differ for some families (transformers 5 fuses Mixtral's experts into 3-D
tensors), and vLLM's CPU mixture-of-experts kernel needs its weights packed again after a
reload. Each family: new weights pushed the way the trainers push them (`checkpoint_names`,
then `load_weights`: a broadcast to the engine's workers in buckets), after which the engine's
greedy responses and log-probs equal the trainer's own model's.

The broadcast itself (`hpcrlhf.engines.weight_sync`) is checked without vLLM: three processes,
every dtype and size case, bit-exact.
"""

from __future__ import annotations

import io
import os
import time

import pytest
import torch

from hpcrlhf.engines.rollout import SamplingParams
from hpcrlhf.engines.rollout.hf import HFRollout
from hpcrlhf.models.export import checkpoint_names
from hpcrlhf.models.loading import load_causal_lm, load_tokenizer
from hpcrlhf.models.tiny import build_tiny_model_dir
from tests.engines.test_rollout import engine_tol, max_logprob_error, one_torch_thread, perturbed, tokens  # noqa: F401


@pytest.mark.parametrize("family", ["mistral", "mixtral", "qwen2", "gpt2"])
def test_weight_sync_follows_the_trainer_for_each_family(family):
    pytest.importorskip("vllm")
    from hpcrlhf.engines.rollout.vllm import VLLMRollout

    folder = str(build_tiny_model_dir(family))
    tokenizer = load_tokenizer(folder)
    model = load_causal_lm(folder, attn_implementation="sdpa")
    prompts = [tokenizer(t)["input_ids"] for t in ("12+34=", "7+8=", "99+1=", "5+55=")]
    greedy = SamplingParams(greedy=True, max_new_tokens=12)
    hf = HFRollout(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, device="cpu")
    engine = VLLMRollout(folder, max_model_len=64, kv_cache_bytes=1 << 26)
    try:
        before = engine.generate(prompts, greedy)
        assert tokens(before) == tokens(hf.generate(prompts, greedy))
        model.load_state_dict(perturbed(model.state_dict(), std=0.05, seed=1))
        engine.bucket_bytes = 1 << 14  # many buckets, and tensors larger than one
        sent = engine.load_weights(checkpoint_names(model, model.state_dict()))
        assert sent.buckets > 4
        after = engine.generate(prompts, greedy)
        assert tokens(after) != tokens(before)  # the update reached the engine ...
        assert tokens(after) == tokens(hf.generate(prompts, greedy))  # ... whole and in the right layout
        assert max_logprob_error(model, after) < engine_tol()
    finally:
        engine.close()


def test_checkpoint_names_are_the_saved_names(tmp_path):
    """What weight sync sends is what `save_pretrained` writes (names and values), for a family
    whose in-memory layout differs from its checkpoints."""
    from safetensors.torch import load_file

    model = load_causal_lm(str(build_tiny_model_dir("mixtral")), attn_implementation="sdpa")
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in model.state_dict())
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    sent = checkpoint_names(model, model.state_dict())
    assert sorted(sent) == sorted(saved)
    assert all(torch.equal(sent[k], saved[k]) for k in saved)


def _tensors():
    """Every case a bucket must handle: dtypes of 1-8 bytes, a scalar, a tensor larger than the
    bucket (sent alone), a non-contiguous one, and a bucket filled exactly."""
    g = torch.Generator().manual_seed(0)
    yield "a.weight", torch.randn(3, 5, generator=g)
    yield "a.half", torch.randn(7, generator=g).to(torch.bfloat16)
    yield "big.weight", torch.randn(100, 10, generator=g)  # 4000 bytes > the 200-byte buckets
    yield "b.index", torch.arange(6, dtype=torch.int64).reshape(2, 3)
    yield "b.mask", torch.tensor([True, False, True])
    yield "c.scalar", torch.tensor(2.5, dtype=torch.float64)
    yield "c.transposed", torch.randn(4, 6, generator=g).t()
    yield "d.exact", torch.randn(50, generator=g)  # 200 bytes: a bucket of its own, full


def _long_header_tensors():
    """One bucket of 1500 scalars (a header over `HEADER_BYTES`: sent in two broadcasts), then a
    tensor larger than the bucket, sent alone last (an empty last header follows it)."""
    for i in range(1500):
        yield f"model.layers.{i}.a_rather_long_module_name_as_in_real_checkpoints.weight", torch.tensor([float(i)])
    yield "lm_head.weight", torch.arange(70000, dtype=torch.float32)


SYNCS = (_tensors, _tensors, _long_header_tensors)


def _member(spec, rank, queue) -> None:
    from hpcrlhf.engines import weight_sync

    group = weight_sync.join(spec, rank)
    for _ in SYNCS:  # several syncs in the same group
        received = list(weight_sync.receive(group))  # every view kept to the end, as a layer-wise loader may
        buffer = io.BytesIO()  # as bytes: a tensor put in a queue is shared with its sender, who exits
        torch.save([(k, v.clone()) for k, v in received], buffer)
        queue.put((rank, group.backend, buffer.getvalue()))


def count_collectives(group) -> list[str]:
    """Record the names of the collectives `group` runs from now on (cleared by the caller)."""
    calls: list[str] = []
    for name in ("broadcast", "barrier"):
        method = getattr(group, name)
        setattr(group, name, lambda *args, name=name, method=method: (calls.append(name), method(*args))[1])
    return calls


@pytest.mark.parametrize("transport", [None, "shm"])
def test_broadcast_delivers_every_tensor_bit_exact_in_order(transport):
    """gloo (what CPU members pick), and "shm": buckets handed over as shared files, the CPU twin
    of CUDA IPC (members on one GPU) -- the sender refills its one bucket only after every member
    copied it, so views a member keeps stay intact."""
    import glob
    import multiprocessing

    from hpcrlhf.engines import weight_sync

    ctx = multiprocessing.get_context("spawn")
    store, at = weight_sync.serve_store("127.0.0.1", timeout_s=120)
    spec = weight_sync.SyncGroup(at, 3, "test", timeout_s=120, transport=transport)
    queue = ctx.Queue()
    members = [ctx.Process(target=_member, args=(spec, rank, queue)) for rank in (1, 2)]
    for m in members:
        m.start()
    try:
        group = weight_sync.join(spec, 0, store)
        assert group.backend == (transport or "gloo")
        collectives = count_collectives(group)
        # buckets; collectives: gloo two a bucket (header, payload), "shm" two (header with the
        # handle, barrier), plus a header's second part or a last empty header where there is one
        plan = {_tensors: (200, 4, 8),  # [a.weight a.half] [big] [b.* c.*] [d.exact], the last marked last
                    _long_header_tensors: (1 << 18, 2, (2 + 1) + (1 + 1) + 1)}  # [1500 scalars] [lm_head] []
        for stream in SYNCS:
            want = list(stream())
            sizes = [t.numel() * t.element_size() for _, t in want]
            bucket_bytes, buckets, calls = plan[stream]
            collectives.clear()
            sent = weight_sync.WeightSender(group, bucket_bytes).send(stream())
            assert sent.tensors == len(want) and sum(sizes) <= sent.bytes < sum(sizes) + 16 * len(want)
            assert sent.buckets == buckets and len(collectives) == calls, collectives
            for _ in members:
                rank, backend, blob = queue.get(timeout=120)
                assert backend == group.backend
                got = torch.load(io.BytesIO(blob), weights_only=True)
                assert [k for k, _ in got] == [k for k, _ in want], rank
                for (name, t), (_, expected) in zip(got, want):
                    assert t.dtype == expected.dtype and t.shape == expected.shape and torch.equal(t, expected), name
        assert not glob.glob(f"/dev/shm/hpcrlhf-sync-{os.getpid()}")  # the shared bucket is gone after a sync
    finally:
        for m in members:
            m.join(timeout=60)
            m.kill()


def _armed_member(spec, queue) -> None:
    from hpcrlhf.engines import weight_sync

    queue.put("joining")  # started: the 2-s timeout is for the sync, not for spawning
    group = weight_sync.join(spec, 1)
    buffer = io.BytesIO()  # as bytes: a tensor put in a queue is shared with its sender, who exits
    torch.save([(k, v.clone()) for k, v in weight_sync.receive(group)], buffer)
    queue.put(buffer.getvalue())


def _rank0_then_gone(queue) -> None:
    from hpcrlhf.engines import weight_sync

    store, at = weight_sync.serve_store("127.0.0.1", timeout_s=300)
    spec = weight_sync.SyncGroup(at, 2, "orphan", timeout_s=300)
    queue.put(spec)
    weight_sync.join(spec, 0, store)
    time.sleep(600)  # killed by the test


def test_a_member_armed_long_before_a_sync_waits_for_it_past_the_group_timeout():
    """An engine armed while the actor trains waits longer than the group's collective timeout (2 s
    here; 30 minutes in a run), then receives the sync whole."""
    import multiprocessing

    from hpcrlhf.engines import weight_sync

    ctx = multiprocessing.get_context("spawn")
    store, at = weight_sync.serve_store("127.0.0.1", timeout_s=2)
    spec = weight_sync.SyncGroup(at, 2, "armed", timeout_s=2)
    queue = ctx.Queue()
    member = ctx.Process(target=_armed_member, args=(spec, queue))
    member.start()
    try:
        assert queue.get(timeout=60) == "joining"
        group = weight_sync.join(spec, 0, store)
        time.sleep(5)  # training, while the member waits: 2.5 group timeouts
        weight_sync.WeightSender(group, 200).send(_tensors())
        got = torch.load(io.BytesIO(queue.get(timeout=60)), weights_only=True)
        assert [k for k, _ in got] == [k for k, _ in _tensors()]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, _tensors()))
    finally:
        member.join(timeout=30)
        member.kill()


def test_a_member_waiting_for_a_sync_fails_at_once_when_rank_0_is_gone():
    """The wait is in rank 0's store: its process killed (an actor rank lost while training), the
    armed member's receive raises within seconds instead of waiting for the group's timeout."""
    import multiprocessing

    from torch.distributed import DistError

    from hpcrlhf.engines import weight_sync

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    rank0 = ctx.Process(target=_rank0_then_gone, args=(queue,))
    rank0.start()
    try:
        group = weight_sync.join(queue.get(timeout=60), 1)
        rank0.kill()
        began = time.monotonic()
        with pytest.raises(DistError):
            list(weight_sync.receive(group))
        assert time.monotonic() - began < 30
    finally:
        rank0.kill()


def test_the_transport_follows_the_members_devices():
    from hpcrlhf.engines.weight_sync import choose_backend

    assert choose_backend(["cpu", "cpu", "cpu"]) == "gloo"
    assert choose_backend(["GPU-a", "GPU-b", "GPU-c"]) == "nccl"
    assert choose_backend(["GPU-a", "GPU-a"]) == "cuda_ipc"  # a colocated TP-1 engine beside actor rank 0
    assert choose_backend(["GPU-a", "GPU-a", "GPU-b"]) == "gloo"  # NCCL refuses two ranks on one GPU
    assert choose_backend(["GPU-a", "cpu"]) == "gloo"


def test_state_chunks_cut_between_modules_only():
    from hpcrlhf.engines.deepspeed_engine import _module_chunks

    state = {"m.0.q.weight": torch.zeros(10), "m.0.q.bias": torch.zeros(10), "m.0.k.weight": torch.zeros(30),
             "m.1.experts.gate_up": torch.zeros(5), "m.1.experts.down": torch.zeros(5), "head.weight": torch.zeros(1)}
    chunks = list(_module_chunks(state, 60))
    assert [n for c in chunks for n in c] == list(state)  # all, in order, once
    assert chunks == [["m.0.q.weight", "m.0.q.bias"], ["m.0.k.weight"], ["m.1.experts.gate_up", "m.1.experts.down",
                                                                           "head.weight"]]
    assert list(_module_chunks(state, 10**9)) == [list(state)]
