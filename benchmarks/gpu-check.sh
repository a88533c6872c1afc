#!/usr/bin/env bash
# One-command GPU check: on a machine with a CUDA GPU, install what is missing, run the GPU-only
# tests (tests/gpu: bf16 under ZeRO-0/2/3, bf16 PPO that learns, the weight broadcast between GPU
# processes, and -- where installed -- flash-attn, QLoRA, a vLLM CUDA engine), then the
# single-GPU bench suites `gpu-1` and `gpu-1-longtail`. Everything it writes goes under one folder:
#   $OUT_DIR/env.txt            versions, GPU, what was skipped and why
#   $OUT_DIR/tests.log          pytest -v output of tests/gpu
#   $OUT_DIR/bench/             hpcrlhf bench results (results.json, results.md, plots, each run's log)
#   $OUT_DIR/bench-longtail/    the same for gpu-1-longtail (sync vs k steps ahead, partial rollouts)
#
# Usage: bash benchmarks/gpu-check.sh [OUT_DIR] [--site TARBALL] [--no-install] [--no-tests] [--no-bench]
#                                      [--no-longtail] [--longtail-only] [--tests PATHS] [-k TESTS] [--systems A,B]
#   OUT_DIR        default benchmarks/results/gpu-1-<gpu name>
#   --site FILE    offline machines: a .tar.xz/.tgz of a site-packages folder (benchmarks/gpu-site.sh,
#                  `--vllm` for vLLM) unpacked and put on PYTHONPATH instead of pip installing; where
#                  FILE is missing but its FILE.part-NN pieces (gpu-site.sh --split) are there, they are joined
#   --no-install   use the Python environment as it is
#   --tests PATHS  the test files to run (space-separated; default tests/gpu): CPU tests whose claim
#                  holds on a GPU too run here with the engine on cuda (e.g. tests/engines/test_rollout.py)
#   -k TESTS       run only the tests pytest's -k selects (e.g. vllm)
#   --systems A,B  run only these systems of the gpu-1 suite
#   --no-longtail  skip gpu-1-longtail; --longtail-only: run nothing else (no tests, no gpu-1)
#   --longtail-suite NAME  the long-tail suite to run (default gpu-1-longtail; gpu-1-longtail-1k: a longer tail)
# Needs: python3 with a CUDA build of torch. With the package index reachable it installs
# `.[gpu,hpc,lora,bench,dev]` over that torch (never replacing it).
set -uo pipefail
cd "$(dirname "$0")/.."
out="" site="" install=1 tests=1 bench=1 longtail=1 select=() systems=() paths=(tests/gpu) tail_suite=gpu-1-longtail
while [ $# -gt 0 ]; do
  case "$1" in
    --site) site="$2"; shift 2 ;;
    --no-install) install=0; shift ;;
    --no-tests) tests=0; shift ;;
    --no-bench) bench=0; shift ;;
    --no-longtail) longtail=0; shift ;;
    --longtail-only) tests=0; bench=0; shift ;;
    --longtail-suite) tail_suite="$2"; shift 2 ;;
    --tests) read -ra paths <<< "$2"; shift 2 ;;
    -k) select=(-k "$2"); shift 2 ;;
    --systems) systems=(--systems "$2"); shift 2 ;;
    -h|--help) sed -n 2,25p "$0"; exit 0 ;;
    -*) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) out="$1"; shift ;;
  esac
done
PY=${PYTHON:-python3}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: $PY has no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine" >&2
  exit 2
fi
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name(0).split()[-1].split('-')[0].lower())")
out=${out:-benchmarks/results/gpu-1-$gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ -n "$site" ]; then
  if [ ! -f "$site" ] && compgen -G "$site.part-*" >/dev/null; then cat "$site".part-* > "$site" || exit 3; fi
  if [ ! -f /tmp/hpcrlhf-site/.unpacked ]; then  # a second call on the same machine reuses it
    mkdir -p /tmp/hpcrlhf-site
    case "$site" in
      *.xz) xz -T0 -dc "$site" | tar x -C /tmp/hpcrlhf-site || exit 3 ;;  # gpu-site.sh writes multi-block xz
      *) tar xf "$site" -C /tmp/hpcrlhf-site || exit 3 ;;
    esac
    touch /tmp/hpcrlhf-site/.unpacked
  fi
  inner=$(find /tmp/hpcrlhf-site -maxdepth 2 -name ray -type d | head -1)
  export PYTHONPATH="$PYTHONPATH:$(dirname "${inner:-/tmp/hpcrlhf-site/x}")"
  # unpacked wheels bring no console scripts: the Ray runtime starts its cluster with `ray start`
  mkdir -p /tmp/hpcrlhf-site/bin
  printf '#!/bin/sh\nexec %s -c "import sys; from ray.scripts.scripts import main; sys.argv[0] = '\''ray'\''; main()" "$@"\n' \
    "$(command -v "$PY")" > /tmp/hpcrlhf-site/bin/ray && chmod +x /tmp/hpcrlhf-site/bin/ray
  export PATH="/tmp/hpcrlhf-site/bin:$PATH"
  # gpu-site.sh leaves flashinfer out; vLLM 0.26 imports it for its sampler unless told not to
  $PY -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
elif [ "$install" = 1 ]; then
  torch_pin=$($PY -c "import torch; print(torch.__version__.split('+')[0])")
  echo "torch==$torch_pin" > /tmp/gpu-check-constraints.txt  # keep the machine's CUDA torch
  PIP_CONSTRAINT=/tmp/gpu-check-constraints.txt $PY -m pip install -q -e ".[gpu,hpc,lora,bench,dev]" || exit 3
fi

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"; nvidia-smi -L 2>/dev/null; git rev-parse --short HEAD 2>/dev/null
  $PY - <<'EOF'
import importlib, importlib.util, platform
import torch
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"GPU {torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
for name in ("transformers", "deepspeed", "ray", "datasets", "vllm", "flash_attn", "bitsandbytes", "trl", "peft"):
    if importlib.util.find_spec(name) is None:
        print(f"{name}: not installed (its GPU paths are skipped)")
    else:
        print(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
EOF
} 2>&1 | tee "$out/env.txt"

status=0
if [ "$tests" = 1 ]; then
  $PY -m pytest "${paths[@]}" "${select[@]}" -v -rs -p no:cacheprovider --timeout 900 2>&1 | tee "$out/tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "$bench" = 1 ]; then
  $PY -m hpcrlhf bench --suite gpu-1 "${systems[@]}" -o "$out/bench" || status=$?
fi
if [ "$longtail" = 1 ]; then  # sync against k steps ahead with partial rollouts, long-tail lengths
  $PY -m hpcrlhf bench --suite "$tail_suite" -o "$out/bench-longtail" || status=$?
fi
echo "gpu-check: results in $out (exit $status)"
exit $status
