#!/usr/bin/env bash
# Packages for `gpu-check.sh --site` on a GPU machine that has a CUDA torch but no package index:
# downloads (here, where pip works) the wheels hpcrlhf needs beside torch for that machine's
# Python, unpacks them into one site-packages folder, drops what no hpcrlhf path imports (Ray's
# Java jars, dashboard UI, RLlib/Serve/Tune/Train/Data) and packs it as one .tar.xz (~38 MB: under
# the 64 MiB a lent machine's call can carry).
# Usage: bash benchmarks/gpu-site.sh OUT.tar.xz [PYTHON_VERSION, default 3.12]
# The versions are constraints.txt's, so the GPU run uses the code paths CI tests. What the target
# image already has (torch, numpy, pyarrow, pandas, msgpack, protobuf, peft, ...) is not included;
# vLLM, flash-attn and bitsandbytes are not either (too large to carry; gpu-check skips their tests).
set -euo pipefail
out=${1:?usage: gpu-site.sh OUT.tar.xz [PYTHON_VERSION]}
py=${2:-3.12}
here=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$here/.venv/bin/python}  # needs torch: DeepSpeed's setup imports it
[ -x "$PY" ] || PY=python3
pin() { grep -E "^$1==" "$here/constraints.txt" | head -1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
get() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp $platforms -d "$work/whl" "$@"; }
get "$(pin ray)" "$(pin datasets)" "$(pin submitit)" "$(pin transformers)" "$(pin tokenizers)" "$(pin trl)" \
    dill multiprocess hjson jsonschema jsonschema-specifications referencing rpds-py pydantic pydantic-core \
    annotated-types typing-inspection
# DeepSpeed is published as a source archive; built without its C++/CUDA ops it is pure Python.
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$work/src" "$(pin deepspeed)"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/whl" "$work"/src/deepspeed-*.tar.gz
mkdir -p "$work/site312"
for w in "$work"/whl/*.whl; do "$PY" -m zipfile -e "$w" "$work/site312"; done
( cd "$work/site312" && rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/tests ray/*/tests ray/llm ray/serve \
    ray/data ray/tune ray/train ray/air/examples )
tar cJf "$out" -C "$work" site312
echo "gpu-site: $(du -h "$out" | cut -f1) in $out; on the GPU machine: bash benchmarks/gpu-check.sh --site $out"
