#!/usr/bin/env bash
# Seconds and peak memory of `hpcrlhf plan` (text, then --json) for ppo-7b on NODES x 8 GPUs, every GPU
# its roles leave (12 of them) given to a TP-1 vLLM engine: NODES x 8 - 12 engines, the most a plan
# places. Planning must grow linearly with the engines (tests/placement/test_scale.py counts the work;
# this times it).
#
# Usage: bash benchmarks/plan-scale.sh [NODES ...]        (default: 16000 100000 = 127,988 and 799,988 engines)
#   run from the checkout whose code to time; PYTHON (default python) and TIMEOUT (seconds per plan,
#   default 600) from the environment. Before/after in one run:
#   (cd OLD && bash NEW/benchmarks/plan-scale.sh) && bash benchmarks/plan-scale.sh
set -euo pipefail
PYTHON=${PYTHON:-python}
TIMEOUT=${TIMEOUT:-600}
[ $# -gt 0 ] || set -- 16000 100000
took=$(mktemp)
trap 'rm -f "$took"' EXIT
for nodes in "$@"; do
  engines=$((nodes * 8 - 12))
  for flag in "" --json; do
    # rollout.prompts_per_step: a multiple of the engines, and x 32 of the batch size (128)
    if /usr/bin/time -f "%e %M" -o "$took" timeout "$TIMEOUT" \
        env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m hpcrlhf plan ppo-7b $flag --nodes "$nodes" \
        --set placement.vllm.engines="$engines" --set rollout.prompts_per_step=$((engines * 32)) >/dev/null; then
      read -r seconds kib <"$took"
      echo "$nodes nodes  $engines engines  ${flag:-text}: $seconds s, $((kib / 1024)) MiB"
    else
      echo "$nodes nodes  $engines engines  ${flag:-text}: failed or stopped after $TIMEOUT s"
    fi
  done
done
