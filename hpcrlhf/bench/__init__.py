"""`hpcrlhf bench`: PPO throughput of several systems on the same models, data, lengths and
hardware, in one run.

- `suites`: what is compared (systems, shapes, lengths, steps) -- one typed `Suite` per name.
- `runner`: runs every system of a suite as a real job (`hpcrlhf train ppo`, under torchrun or
  srun for the all-ranks DeepSpeed-Chat-style baseline), then reads its `metrics.jsonl`.
- `measure`: per-phase medians, samples/s, tokens/s, generation share, MFU (pure functions).
- `flops`: model FLOPs per token from a Hugging Face config (pure).
- `peak`: the device's measured matmul peak and memory bandwidth.
- `stepmodel`: a step-time model fitted from measured phase costs, to predict larger shapes.
- `dschat`: the real DeepSpeed-Chat step 3 (command line and log parser).
- `report`: results.json, results.md and PNG plots.
"""
