"""The RL maths: pure tensor functions, each tested against a hand-computed or float64 reference
(tests/algos/, one test module per module here).

- `masked`: sums, means and whitening over the masked tokens, global over data-parallel ranks
- `kl`: the k1/k2/k3 KL estimates and the fixed/adaptive KL coefficient controllers
- `reward_shaping`: sequence scores -> per-token rewards; clipping, running normalisation
- `advantages`: GAE, returns-to-go and the advantage estimators (`estimators`: what each needs)
- `ppo`: the clipped policy and value losses, their aggregation, entropy, truncated importance weights
- `preference`, `logprobs`, `conditioning`: DPO/IPO/KTO and reward-model losses, token log-probs,
  conditional-SFT buckets

Conventions: per-token tensors are (B, T) and `mask` marks the action (response) tokens. Masked
tokens of a row are the consecutive time steps of one episode, which ends after the row's last
masked token; masked-out positions are ignored wherever they are (padding, or holes inside a
response), and every per-token output is exactly 0 there. Values at masked-out positions are never
read arithmetically into a result (selected with `torch.where`, not multiplied by the mask), so
-inf or NaN padding cannot leak in.

Functions computing batch statistics take `reduce`, a callable that sums a list of Python floats
over data-parallel ranks (None: one process). Local sums are accumulated in float64, reduced in
one call, and only then turned into means and variances, so every rank sees the statistics of the
global batch. Half-precision inputs are computed in fp32 and cast back (house convention, see
`hpcrlhf.algos.preference`).
"""
