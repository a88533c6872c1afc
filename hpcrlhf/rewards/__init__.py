"""Rewards and evaluation metrics: what scores a generated response.

- `response`: what a rule scores (`Response`: a response and its row) and what a rule is to its
  callers (`Scorer`)
- `rules`: the contract of a rule (a function of (prompt, response, row) returning a number, checked
  on every call), names resolved to rules, evaluation metrics (`EvalMetrics`)
- `sources`: `reward.sources` as one `RewardSet` (reward models and rules, weighted and summed),
  and the score penalties
- `builtin`: the rules hpcrlhf ships (`math`, `code`, `format`) and their registry
- `math_answers`, `math_worker`: the `math` rule: the final answer found in the response, checked
  against the reference with math-verify in worker processes that a deadline can kill
- `code_tests`: the `code` rule: the response's program run against the row's tests
- `sandbox`, `sandbox_launch`: where a program runs: limits, namespaces, nothing left behind
- `remote`: reward servers (`reward.sources[i].url`), asked over HTTP
- `workers`: processes checking answers (and requests to servers) in parallel, each with a deadline

The package imports nothing itself, so a worker process (`python -m hpcrlhf.rewards.math_worker`)
starts without torch.
"""
