"""Weight-sync benchmark: the actor's weights into vLLM engines, collective vs object store.

`python -m hpcrlhf.bench.weight_sync -o DIR` builds a Llama of `--params` parameters from config
(no download), starts a local Ray cluster and `--engines` vLLM engine actors (`EngineWorker`, as
a Ray run does), then times both sync paths of `placement.vllm.weight_sync` in the same run,
alternating, `--repeats` times each:

- object_store: the state dict `ray.put` once, each engine actor fetches it and loads it into
  its workers (what `ActorWorker.put_weights` does after rank 0 holds the full state dict);
- collective: this process is rank 0 of a weight-sync group with every engine worker and
  broadcasts the state dict in `--bucket-mb` buckets (what `ActorWorker.broadcast_weights` does).

The actor's own gather (ZeRO-3) is the same for both and left out. Each sync is checked: after
it, every engine's greedy answers equal the model's. Writes `weight_sync.json` (every timing,
bytes, GB/s, the ratio) and `weight_sync.png`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from hpcrlhf.cluster.engines import EngineWorker
from hpcrlhf.cluster.local import start_local_cluster
from hpcrlhf.engines import weight_sync
from hpcrlhf.engines.rollout import SamplingParams
from hpcrlhf.engines.rollout.hf import HFRollout
from hpcrlhf.logs import get_logger
from hpcrlhf.models.loading import load_causal_lm
from hpcrlhf.models.tiny import build_sized_llama_dir
from hpcrlhf.plots import figure

log = get_logger()


def perturb(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def run(out: Path, params_m: float, engines: int, repeats: int, bucket_mb: int) -> dict:
    import ray

    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    folder = build_sized_llama_dir(params_m)
    model = load_causal_lm(str(folder), attn_implementation="sdpa")
    n_params = sum(p.numel() for p in model.parameters())
    state = model.state_dict()
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    log.info(f"model: {n_params / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB in fp32; {engines} engine(s)")
    prompts = [[1, 5, 9, 13, 2 + i] for i in range(4)]
    greedy = SamplingParams(greedy=True, max_new_tokens=6)
    hf = HFRollout(model, pad_token_id=model.config.pad_token_id, eos_token_id=model.config.eos_token_id, device="cpu")
    timings: dict[str, list[float]] = {"object_store": [], "collective": []}
    with start_local_cluster(1, engines, cpus_per_node=engines + 1, root=root) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            actor = ray.remote(EngineWorker).options(num_cpus=0)
            workers = [actor.remote("vllm", i, engines, str(folder), tensor_parallel_size=1, max_model_len=64,
                                    kv_cache_bytes=1 << 27) for i in range(engines)]
            store, at = weight_sync.serve_store("127.0.0.1")
            spec = weight_sync.SyncGroup(at, 1 + engines, "bench-weights")
            joined = [w.join_weight_group.remote(spec, 1 + i) for i, w in enumerate(workers)]
            group = weight_sync.join(spec, 0, store)
            ray.get(joined)
            sender = weight_sync.WeightSender(group, bucket_mb << 20)
            for i in range(2 * repeats):
                path = ("object_store", "collective")[i % 2]
                model.load_state_dict(perturb(state, i))
                current = model.state_dict()
                began = time.perf_counter()
                if path == "object_store":
                    ref = ray.put({k: v.detach() for k, v in current.items()})
                    ray.get([w.load_weights.remote(ref) for w in workers])
                    del ref
                else:
                    receiving = [w.receive_weights.remote() for w in workers]
                    sender.send(current.items())
                    ray.get(receiving)
                timings[path].append(time.perf_counter() - began)
                want = [g[0].response_ids for g in hf.generate(prompts, greedy)]
                for w in workers:  # the sync is complete and right
                    got = [g[0].response_ids for g in ray.get(w.generate.remote(prompts, greedy))]
                    if got != want:
                        raise RuntimeError(f"{path} sync {i}: an engine's greedy answers differ from the model's")
                log.info(f"{path}: {timings[path][-1]:.2f} s")
            ray.get([w.close.remote() for w in workers])
        finally:
            ray.shutdown()
    result = {"command": " ".join(["python -m hpcrlhf.bench.weight_sync", *sys.argv[1:]]), "params": n_params, "bytes": nbytes, "engines": engines, "bucket_mb": bucket_mb, "repeats": repeats,
              "host": platform.node(), "cpu": platform.processor() or platform.machine(),
              "torch": torch.__version__, "seconds": timings}
    for path, values in timings.items():
        median = statistics.median(values)
        result[path] = {"median_s": median, "gb_per_s": nbytes * engines / median / 1e9}
    result["object_store_over_collective"] = result["object_store"]["median_s"] / result["collective"]["median_s"]
    (out / "weight_sync.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "weight_sync.png")
    return result


def plot(result: dict, path: Path) -> None:
    names = ["object_store", "collective"]
    with figure(path) as (_, (ax,)):
        ax.bar(names, [result[n]["median_s"] for n in names], color=["#999999", "#1f77b4"])
        for i, n in enumerate(names):
            ax.text(i, result[n]["median_s"], f"{result[n]['median_s']:.2f} s\n{result[n]['gb_per_s']:.2f} GB/s",
                    ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("seconds per sync (median)")
        ax.set_title(f"weight sync, {result['params'] / 1e6:.0f}M params into {result['engines']} vLLM engine(s)",
                     fontsize=9)
        ax.margins(y=0.25)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hpcrlhf.bench.weight_sync", description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--output", type=Path, required=True)
    p.add_argument("--params", type=float, default=60.0, help="model size in millions of parameters (default 60)")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=256)
    args = p.parse_args(argv)
    result = run(args.output, args.params, args.engines, args.repeats, args.bucket_mb)
    print(json.dumps({k: result[k] for k in ("params", "object_store", "collective", "object_store_over_collective")}))


if __name__ == "__main__":
    main()
