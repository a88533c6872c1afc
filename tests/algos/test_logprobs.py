import math

import torch

from hpcrlhf.algos.logprobs import nll_sum, token_logprobs


def test_token_logprobs_match_float64_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    labels = torch.tensor([[1, 2, -100, 4, 6], [0, -100, -100, 3, 5]])
    got = token_logprobs(logits, labels)
    for b in range(2):
        for t in range(5):
            if labels[b, t] == -100:
                assert got[b, t] == 0
                continue
            row = logits[b, t].double()
            ref = row[labels[b, t]] - math.log(sum(math.exp(x) for x in row.tolist()))
            assert abs(got[b, t].item() - ref) < 1e-5


def test_nll_sum_is_minus_sum_of_logprobs_and_counts_labelled_tokens():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 11, generator=g)
    labels = torch.randint(0, 11, (3, 4), generator=g)
    labels[0, :2] = -100
    loss, n = nll_sum(logits, labels)
    assert n == 10
    assert torch.allclose(loss, -token_logprobs(logits, labels).sum(), atol=1e-5)
