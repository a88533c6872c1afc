"""Rollouts with Hugging Face `generate` on the trainer's own module (`HFRollout`): slow, always
available, in sync with the trained weights by construction."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from hpcrlhf.engines.hf_generate import left_pad, stop_on_request
from hpcrlhf.engines.rollout.contract import Generation, SamplingParams, check_prompts, greedy_copies


def _cut_at_eos(tokens: list[int], logprobs: list[float], eos_token_id: int) -> tuple[list[int], list[float], bool]:
    """The response up to and including its first EOS (what follows is padding)."""
    if eos_token_id in tokens:
        end = tokens.index(eos_token_id) + 1
        return tokens[:end], logprobs[:end], True
    return tokens, logprobs, False


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
        check_prompts(prompts)
        if params.lengths is not None:
            raise ValueError("HFRollout: per-prompt response lengths (rollout.length_key) need a vLLM engine")
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
            result.append(greedy_copies(samples[0], params.n) if params.greedy else samples)
        return result

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Nothing to do: the engine generates with the trainer's own module (shared weights)."""

    def close(self) -> None:
        """Nothing to free: the module belongs to the trainer."""
