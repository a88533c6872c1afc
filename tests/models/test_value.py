"""Value models on every tiny family: per-token values from backbone + head equal transformers'
own pooled sequence-classification output at the last token; reward normalisation."""

from __future__ import annotations

import types

import pytest
import torch

from hpcrlhf.models.tiny import TINY_FAMILIES, build_tiny_model_dir
from hpcrlhf.models.value import ValueModel, last_token_values, load_value_model, normalized_rewards


def test_last_token_values_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert last_token_values(values, mask).tolist() == [3.0, 8.0]


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_values_match_transformers_pooling(family):
    torch.manual_seed(0)
    model = load_value_model(str(build_tiny_model_dir(family)), pad_token_id=0).eval()
    ids = torch.tensor([[1, 40, 41, 42, 2, 0, 0], [1, 43, 44, 45, 46, 47, 2]])
    mask = (ids != 0).long()
    with torch.no_grad():
        values = ValueModel(model)(ids, attention_mask=mask)
        pooled = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    assert values.shape == ids.shape and values.dtype == torch.float32
    torch.testing.assert_close(last_token_values(values, mask), pooled.float(), rtol=1e-5, atol=1e-5)


def test_normalized_rewards():
    cfg = types.SimpleNamespace(reward_mean=2.0, reward_std=4.0)
    assert normalized_rewards(torch.tensor([2.0, 6.0]), cfg).tolist() == [0.0, 1.0]
    assert normalized_rewards(torch.tensor([3.0]), types.SimpleNamespace()).tolist() == [3.0]
