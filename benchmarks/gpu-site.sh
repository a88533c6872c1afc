#!/usr/bin/env bash
# Packages for `gpu-check.sh --site` on a GPU machine that has a CUDA torch but no package index:
# downloads (here, where pip works) the wheels hpcrlhf needs beside torch for that machine's
# Python, unpacks them into one site-packages folder, drops what no hpcrlhf path imports (Ray's
# Java jars, dashboard UI, RLlib/Serve/Tune/Train/Data) and packs it as one .tar.xz (~38 MB: under
# the 64 MiB a lent machine's call can carry).
#
# Usage: bash benchmarks/gpu-site.sh OUT.tar.xz [--python 3.12] [--vllm VERSION] [--split MIB]
#   --vllm VERSION  add vLLM and the runtime packages it imports that the lent image ('cuda':
#                   torch 2.11.0+cu130, Python 3.12) lacks. VERSION must be built on the image's
#                   torch: 0.26.0 is the last vLLM on torch 2.11. Dropped from it: FlashAttention-2
#                   kernels (Hopper runs FA3), the Rust API-server binary, and the
#                   optional accelerator packages (flashinfer, CUTLASS DSL, tilelang, video codecs; xgrammar needs tvm-ffi, kept).
#                   Adds ~150 MB.
#   --split MIB     also cut OUT.tar.xz into OUT.tar.xz.part-NN files of at most MIB MiB, to carry
#                   over successive calls of one warm machine; there `cat OUT.tar.xz.part-* > OUT.tar.xz`.
# The versions are constraints.txt's, so the GPU run uses the code paths CI tests. What the target
# image already has (torch, numpy, pyarrow, pandas, msgpack, protobuf, peft, ...) is not included;
# flash-attn and bitsandbytes are not either (gpu-check skips their tests).
set -euo pipefail
out="" py=3.12 vllm="" split=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python) py="$2"; shift 2 ;;
    --vllm) vllm="$2"; shift 2 ;;
    --split) split="$2"; shift 2 ;;
    -h|--help) sed -n 2,19p "$0"; exit 0 ;;
    -*) echo "gpu-site: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [ -z "$out" ] && out="$1" || py="$1"; shift ;;  # old form: OUT PYTHON_VERSION
  esac
done
[ -n "$out" ] || { echo "usage: gpu-site.sh OUT.tar.xz [--python 3.12] [--vllm VERSION] [--split MIB]" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$here/.venv/bin/python}  # needs torch: DeepSpeed's setup imports it
[ -x "$PY" ] || PY=python3
pin() { grep -E "^$1==" "$here/constraints.txt" | head -1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
platforms=""
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 \
         manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do platforms="$platforms --platform ${p}_x86_64"; done
get() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
          $platforms --platform any -d "$work/whl" "$@"; }
get "$(pin ray)" "$(pin datasets)" "$(pin submitit)" "$(pin transformers)" "$(pin tokenizers)" "$(pin trl)" \
    dill multiprocess hjson jsonschema jsonschema-specifications referencing rpds-py pydantic pydantic-core \
    annotated-types typing-inspection
if [ -n "$vllm" ]; then
  # vLLM 0.26.0's runtime requirements missing from the image, as pip resolved them (2026-11) against a
  # stub of the image's torch; the optional GPU-kernel packages are left out (see --help).
  get "vllm==$vllm" apache-tvm-ffi==0.1.10 agent-detector==2.0.0 anthropic==2.14.0 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 \
    cbor2==6.3.0 cffi==2.1.1 compressed-tensors==0.17.0 cryptography==50.0.2 depyf==0.20.0 detect-installer==0.2.1 \
    dnspython==2.9.2 docstring-parser==0.18.0 email-validator==2.4.0 fastapi-cli==0.0.34 fastapi==0.136.3 \
    fastar==0.12.0 googleapis-common-protos==1.76.0 httpcore2==2.16.2 httptools==0.9.0 httpx2==2.16.2 ijson==3.6.0 \
    interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0 lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3 \
    loguru==0.7.3 mcp-types==2.3.0 mcp==2.3.0 mistral-common==1.13.1 model-hosting-container-standards==0.1.16 \
    msgspec==0.22.0 nvtx==0.2.15 openai-harmony==0.0.8 openai==3.57.0 opentelemetry-api==1.45.2 \
    opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2 \
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2 \
    opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp==1.45.2 opentelemetry-proto==1.45.2 \
    opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions-ai==0.5.1 opentelemetry-semantic-conventions==0.66b2 \
    outlines-core==0.2.14 partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 \
    pycountry==26.2.16 pycparser==3.12 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 pyelftools==0.33 \
    pyjwt==2.15.1 python-dotenv==1.2.4 python-json-logger==4.2.0 python-multipart==0.0.34 pyzmq==27.3.0 \
    rich-toolkit==0.20.6 rignore==0.8.1 setproctitle==1.3.8 sniffio==1.3.1 sse-starlette==3.7.0 starlette==1.10.0 \
    truststore==0.10.5 uvicorn==0.54.0 watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.7
fi
# DeepSpeed is published as a source archive; built without its C++/CUDA ops it is pure Python.
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$work/src" "$(pin deepspeed)"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/whl" "$work"/src/deepspeed-*.tar.gz
site="site${py/./}"
mkdir -p "$work/$site"
# Unpacked keeping each member's mode: `python -m zipfile -e` drops the exec bits, and Ray's
# gcs_server and raylet then cannot start (`ray start` failed on the lent H200, 2026-11-26).
"$PY" - "$work/$site" "$work"/whl/*.whl <<'EOF'
import os, sys, zipfile
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path, mode = z.extract(info, sys.argv[1]), (info.external_attr >> 16) & 0o777
            if mode & 0o111:
                os.chmod(path, mode)
EOF
# vLLM's _moe_C kernels stay (47 MB): without them a mixture-of-experts engine cannot start (H200, 2026-11-26)
( cd "$work/$site" && rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/tests ray/*/tests ray/llm ray/serve \
    ray/data ray/tune ray/train ray/air/examples \
    vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs \
    vllm/entrypoints/serve/instrumentator/static )
find "$work/$site" -name '*.so' -path '*vllm*' -exec chmod +x {} +
mkdir -p "$(dirname "$out")"
XZ_OPT=${XZ_OPT:--6 -T0} tar cJf "$out" -C "$work" "$site"
echo "gpu-site: $(du -h "$out" | cut -f1) in $out; on the GPU machine: bash benchmarks/gpu-check.sh --site $out"
if [ -n "$split" ]; then
  rm -f "$out".part-*
  split -b "${split}M" -d "$out" "$out.part-"
  ls -l "$out".part-*
fi
