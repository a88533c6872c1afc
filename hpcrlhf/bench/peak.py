"""The device's measured matmul peak and memory bandwidth: what MFU and the step-time model
are relative to (a datasheet peak is never reached; a measured one is on the same hardware)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class DevicePeak:
    device: str
    """e.g. "cpu (2 threads)" or the CUDA device name."""
    dtype: str
    matmul_flops: float
    """Best FLOP/s of a square matmul over the repetitions."""
    memory_bytes_per_s: float
    """Best bytes/s of a large tensor copy (read + write)."""

    def to_dict(self) -> dict:
        return asdict(self)


def _best_rate(fn, work: float, repeats: int, sync) -> float:
    fn()  # warm-up (allocations, kernel selection)
    sync()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = max(best, work / max(time.perf_counter() - t0, 1e-9))
    return best


def measure_peak(device: str | None = None, *, precision: str = "bf16", size: int | None = None,
                 repeats: int = 5) -> DevicePeak:
    """Matmul FLOP/s in `precision` ("bf16" or "fp32": what the models compute in -- a CPU with
    AMX runs bf16 matmuls many times faster than fp32) and copy bandwidth of `device` (default:
    cuda when available, else cpu)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    n = size or (8192 if cuda else 1024)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    flops = _best_rate(lambda: a @ b, 2.0 * n ** 3, repeats, sync)
    src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bandwidth = _best_rate(lambda: dst.copy_(src), 2.0 * src.numel(), repeats, sync)
    name = torch.cuda.get_device_name(dev) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    return DevicePeak(name, str(dtype).removeprefix("torch."), flops, bandwidth)
