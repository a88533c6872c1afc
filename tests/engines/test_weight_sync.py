"""Weight sync into a real vLLM engine for every model family hpcrlhf ships as a tiny model.

The trainer holds weights as transformers keeps them in memory; vLLM loads checkpoint names and
layouts. The two differ for some families (transformers 5 fuses Mixtral's experts into 3-D
tensors), and vLLM's CPU mixture-of-experts kernel needs its weights packed again after a
reload. Each family: new weights pushed the way the trainers push them (`checkpoint_names`,
then `load_weights`), after which the engine's greedy responses and log-probs equal the
trainer's own model's.
"""

from __future__ import annotations

import pytest
import torch

from hpcrlhf.engines.rollout import HFRollout, SamplingParams
from hpcrlhf.models.export import checkpoint_names
from hpcrlhf.models.loading import load_causal_lm, load_tokenizer
from hpcrlhf.models.tiny import build_tiny_model_dir
from tests.engines.test_rollout import max_logprob_error, one_torch_thread, perturbed, tokens  # noqa: F401

TOL = 1e-4


@pytest.mark.parametrize("family", ["mistral", "mixtral", "qwen2", "gpt2"])
def test_weight_sync_follows_the_trainer_for_each_family(family):
    pytest.importorskip("vllm")
    from hpcrlhf.engines.rollout import VLLMRollout

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
        engine.load_weights(checkpoint_names(model, model.state_dict()))
        after = engine.generate(prompts, greedy)
        assert tokens(after) != tokens(before)  # the update reached the engine ...
        assert tokens(after) == tokens(hf.generate(prompts, greedy))  # ... whole and in the right layout
        assert max_logprob_error(model, after) < TOL
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
