"""Packing: several samples per row must give the same loss as one sample per row."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpcrlhf.algos.logprobs import nll_sum
from hpcrlhf.data.batching import RowList, collate, pack_rows, shard_rows
from hpcrlhf.data.sft import TokenizedSample, tokenize_sft
from hpcrlhf.data.sources import rows_from_records


def test_pack_rows_keeps_order_and_respects_width():
    rows = pack_rows([3, 4, 2, 5, 1, 6], max_length=8)
    assert rows == [[0, 1], [2, 3, 4], [5]]
    assert [i for r in rows for i in r] == list(range(6))
    with pytest.raises(ValueError):
        pack_rows([9], max_length=8)


def test_collate_shifts_labels_and_restarts_positions():
    a = TokenizedSample((1, 2, 3), (False, True, True), "a")
    b = TokenizedSample((4, 5), (False, True), "b")
    batch = collate([[a, b]], pad_id=0, packed=True)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert batch["labels"].tolist() == [[2, 3, -100, 5, -100]]  # never predicts across the boundary
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert "attention_mask" not in batch
    unpacked = collate([[a], [b]], pad_id=0, packed=False)
    assert unpacked["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert unpacked["labels"].tolist() == [[2, 3, -100], [5, -100, -100]]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_packed_loss_equals_unpacked_loss(family):
    from hpcrlhf.models.tiny import build_tiny_model_dir

    path = build_tiny_model_dir(family)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    records = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a, b in [(1, 2), (13, 45), (99, 7), (50, 50), (3, 88)]]
    samples, _ = tokenize_sft(rows_from_records(records, "t"), tok, prompt_key="prompt", response_key="response", max_length=32)
    groups = pack_rows([len(s.input_ids) for s in samples], max_length=24)
    assert any(len(g) > 1 for g in groups)  # the test really packs

    def loss(batch):
        labels = batch.pop("labels")
        with torch.no_grad():
            return nll_sum(model(**batch, use_cache=False).logits, labels)  # as the engine calls it

    unpacked = loss(collate([[s] for s in samples], tok.pad_token_id, packed=False))
    packed = loss(collate([[samples[i] for i in g] for g in groups], tok.pad_token_id, packed=True))
    assert packed[1] == unpacked[1]
    assert packed[0].item() == pytest.approx(unpacked[0].item(), rel=1e-5)


@pytest.mark.parametrize("n, parts, sizes", [(10, 3, [4, 3, 3]), (4, 4, [1, 1, 1, 1]), (2, 3, [1, 1, 0]), (0, 2, [0, 0]),
                                             (7, 3, [3, 2, 2])])
def test_shard_rows_are_contiguous_balanced_and_cover_every_row_once(n, parts, sizes):
    shards = shard_rows(n, parts)
    assert [len(s) for s in shards] == sizes
    assert [i for s in shards for i in s] == list(range(n))


@pytest.mark.parametrize("n, parts, padded", [(7, 3, [[0, 1, 2], [3, 4, 4], [5, 6, 6]]), (2, 3, [[0], [1], [1]]),
                                              (6, 3, [[0, 1], [2, 3], [4, 5]]), (0, 2, [[], []])])
def test_padded_shards_are_equal_and_repeat_their_last_row(n, parts, padded):
    """ZeRO-3 ranks must run the same number of forward passes: every shard as long as the longest,
    each filled with its own last row (an empty one with the batch's last row)."""
    assert shard_rows(n, parts, pad_to_equal=True) == padded


def test_a_row_list_splits_and_joins_like_a_batch():
    rows = RowList("abcdefg")
    shards = rows.split(3, pad_to_equal=True)
    assert shards == [list("abc"), list("dee"), list("fgg")] and all(isinstance(s, RowList) for s in shards)
    assert RowList.concat([s.head(k) for s, k in zip(shards, (3, 2, 2))]) == rows
