"""Rank bodies of the GPU weight-sync test (spawned processes import them by name)."""

from __future__ import annotations

import torch

from hpcrlhf.engines import weight_sync


def broadcast_and_check(rank: int, gpus: int, at) -> None:
    """Rank 0 sends a llama-like state from its GPU in small buckets; rank 1, on its own GPU when
    there are two (NCCL) or on the same one (CUDA IPC: the bucket's handle, copied on the GPU;
    NCCL refuses two ranks on one device), receives it and checks every tensor bit for bit."""
    torch.cuda.set_device(rank % gpus)
    g = torch.Generator().manual_seed(0)
    state = {f"model.layers.{i}.{n}": torch.randn(shape, generator=g).to(dtype)
             for i in range(3) for n, shape, dtype in (("w", (256, 384), torch.bfloat16), ("b", (384,), torch.float32),
                                                       ("big", (1024, 1024), torch.bfloat16))}
    from hpcrlhf.engines import rendezvous

    spec = weight_sync.SyncGroup(at, 2, "gpu-test", timeout_s=120)
    group = weight_sync.join(spec, rank, rendezvous.connect(at, 120))  # the store is the test process's
    assert group.backend == ("nccl" if gpus > 1 else "cuda_ipc"), group.backend
    if rank == 0:
        stats = weight_sync.WeightSender(group, bucket_bytes=1 << 20).send((k, v.cuda()) for k, v in state.items())
        assert stats.tensors == len(state)
    else:
        received = list(weight_sync.receive(group))  # kept until the end: the sender's bucket is refilled meanwhile
        assert all(t.is_cuda for _, t in received)
        got = {name: t.cpu() for name, t in received}
        assert set(got) == set(state)
        for name, tensor in state.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
