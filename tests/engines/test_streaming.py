"""`VLLMStream` (partial rollouts, issue 40): samples as requests of their own whose tokens come back every
engine step, paused across a weight update and continued under the new weights. Checked against vLLM's own
batch (`VLLMRollout.generate`) and, token by token, against log-probs recomputed by the Hugging Face model
with the weights of each token's recorded version."""

from __future__ import annotations

import pytest
import torch

from hpcrlhf.engines.rollout import SamplingParams
from hpcrlhf.engines.rollout.contract import token_versions
from hpcrlhf.engines.rollout.streaming import VLLMStream, sample_seeds, segment_seed
from hpcrlhf.models.loading import load_causal_lm

pytestmark = pytest.mark.slow


def drain(stream: VLLMStream, steps: int | None = None) -> dict[str, object]:
    """Step `stream` until nothing runs (or `steps` engine steps): the samples that ended, by key."""
    done, taken = {}, 0
    while stream.running() and (steps is None or taken < steps):
        done.update(stream.step())
        taken += 1
    return done


def test_a_stream_never_paused_draws_what_a_batch_of_the_same_seeds_does(vllm_rollout, rollout_prompts):
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=7, first_index=5)
    prompts = rollout_prompts[:4]
    stream = VLLMStream(vllm_rollout, params, version=4)
    keys = stream.submit_batch(prompts, params)
    done = drain(stream)
    batch = vllm_rollout.generate(prompts, params)
    assert sorted(done) == sorted(keys) and stream.reprefilled == 0
    for i, gens in enumerate(batch):
        for j, g in enumerate(gens):
            s = done[f"{i}.{j}"]
            assert (s.prompt_ids, s.response_ids, s.finished) == (g.prompt_ids, g.response_ids, g.finished), (i, j)
            assert s.logprobs == pytest.approx(g.logprobs, abs=1e-5) and s.versions == [(0, 4)]
    assert len({tuple(g.response_ids) for gens in batch for g in gens}) > 6  # the samples differ: seeds per sample
    # without partial only the ended samples come back (FINAL_ONLY), whole: the same samples
    final = VLLMStream(vllm_rollout, params, version=4, partial=False)
    final.submit_batch(prompts, params)
    final.submit("short", prompts[0], 5, max_new_tokens=3)  # a sample's own limit (an agent's turn: what is left)
    whole = drain(final)
    assert sorted(whole) == sorted([*keys, "short"])
    for key, g in done.items():
        assert whole[key].response_ids == g.response_ids and whole[key].logprobs == pytest.approx(g.logprobs, abs=1e-5)
    assert 1 <= len(whole["short"].response_ids) <= 3 and whole["short"].versions == [(0, 4)]


def test_sample_seeds_are_those_of_the_batch_request_and_continuations_get_their_own():
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=3)
    (a, b), (c, _) = sample_seeds(params, 0), sample_seeds(params, 1)
    assert b == a + 1 and c not in (a, b)
    assert sample_seeds(SamplingParams(n=2, greedy=True, max_new_tokens=4), 0) == [None, None]
    assert len({a, segment_seed(a, 1), segment_seed(a, 2), segment_seed(b, 1)}) == 4


def logprobs_under(model, prompt: list[int], response: list[int]) -> list[float]:
    """log p(token | context) of each response token under `model` (fp32, teacher-forced)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return [float(logp[len(prompt) + i - 1, t]) for i, t in enumerate(response)]


def old_and_new(model_dir: str, seed: int):
    """The HF model of `model_dir`, and a copy whose every weight moved by 0.05 x N(0, 1) (seeded)."""
    old = load_causal_lm(model_dir, attn_implementation="sdpa").eval()
    new = load_causal_lm(model_dir, attn_implementation="sdpa").eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return old, new


def test_samples_paused_across_a_weight_update_go_on_under_the_new_weights(vllm_rollout, rollout_prompts, tiny_llama):
    """Weights changed after a few engine steps: every sample keeps what it had, records two spans, and each of
    its tokens has the log-prob of the weights of its span (recomputed by the HF model: the prefix was prefilled
    again under the new weights); every sample still has its full length."""
    old, new = old_and_new(tiny_llama, 0)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, min_new_tokens=24, seed=11)
    prompts = rollout_prompts[:3]
    stream = VLLMStream(vllm_rollout, params, version=0)
    stream.submit_batch(prompts, params)
    try:
        early = drain(stream, steps=4)
        assert not early and stream.running() == 6
        stream.publish(1, lambda: vllm_rollout.load_weights(new.state_dict()))
        assert stream.reprefilled >= 6  # each sample had at least a token to prefill again
        done = drain(stream)
    finally:
        vllm_rollout.load_weights(old.state_dict())  # the module's engine as it was
    assert sorted(done) == [f"{i}.{j}" for i in range(3) for j in range(2)]
    for key, g in done.items():
        split = g.versions[1][0]
        assert len(g.response_ids) == 24 and [v for _, v in g.versions] == [0, 1] and 1 <= split < 24, (key, g.versions)
        prompt = g.prompt_ids
        want = (logprobs_under(old, prompt, g.response_ids)[:split]
                + logprobs_under(new, prompt, g.response_ids)[split:])
        assert g.logprobs == pytest.approx(want, abs=2e-4), key
        assert token_versions(g) == [0] * split + [1] * (24 - split)
    # the same tokens under the old weights alone would not match: the check can tell the versions apart
    key, g = next(iter(done.items()))
    assert logprobs_under(old, g.prompt_ids, g.response_ids)[g.versions[1][0]:] != pytest.approx(
        g.logprobs[g.versions[1][0]:], abs=2e-4)


def test_a_paused_stream_can_drop_samples_and_refuses_a_second_owner(vllm_rollout, rollout_prompts):
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=16, min_new_tokens=16, seed=2)
    stream = VLLMStream(vllm_rollout, params)
    stream.submit_batch(rollout_prompts[:3], params)
    drain(stream, steps=2)
    with pytest.raises(RuntimeError, match="one owner at a time"):
        VLLMStream(vllm_rollout, params)
    stream.abort(["1.0"])
    assert stream.running() == 2
    stream.pause()
    stream.abort(["2.0"])
    stream.resume()
    done = drain(stream)
    assert sorted(done) == ["0.0"] and len(done["0.0"].response_ids) == 16
    assert not vllm_rollout.llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="already under way"):
        stream.submit("x", [1, 2], None)
        stream.submit("x", [1, 2], None)
    stream.abort(["x"])
    final = VLLMStream(vllm_rollout, params, partial=False)
    final.submit("y", [1, 2], 4)
    with pytest.raises(RuntimeError, match="without `partial` cannot be paused"):
        final.pause()
    final.abort(["y"])
    assert not vllm_rollout.llm.llm_engine.has_unfinished_requests()


def test_a_benchmarks_lengths_fix_each_prompts_responses(vllm_rollout, rollout_prompts):
    """`SamplingParams.lengths` (rollout.length_key): prompt i's samples have exactly lengths[i] tokens, in a
    batch and in a stream, and a prompt's seeds are those it has without them."""
    lengths = (3, 17, 9)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=4, lengths=lengths)
    batch = vllm_rollout.generate(rollout_prompts[:3], params)
    assert [[len(g.response_ids) for g in gens] for gens in batch] == [[n, n] for n in lengths]
    assert all(not g.finished for gens in batch for g in gens)  # cut at its length, EOS never sampled before
    stream = VLLMStream(vllm_rollout, params)
    stream.submit_batch(rollout_prompts[:3], params)
    done = drain(stream)
    for i, gens in enumerate(batch):
        for j, g in enumerate(gens):
            assert done[f"{i}.{j}"].response_ids == g.response_ids
    free = vllm_rollout.generate(rollout_prompts[:1], SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=4,
                                                                     min_new_tokens=3))
    assert [g.response_ids[:3] for g in free[0]] == [g.response_ids for g in batch[0]]  # the same draws
    with pytest.raises(ValueError, match=r"lengths must be in \[1, max_new_tokens=20\], got \[21\]"):
        SamplingParams(max_new_tokens=20, lengths=(21,))
