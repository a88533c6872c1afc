#!/usr/bin/env bash
# Build hpcrlhf's Apptainer image from its definition file.
#
#   apptainer/build.sh cpu|gpu OUT.sif [extra `apptainer build` arguments]
#
# cpu: Debian 12 from the Debian mirror + the CPU stack (builds on any x86-64 Linux host, no GPU);
# gpu: a CUDA base + torch, vLLM, flash-attn, DeepSpeed (build it on your cluster's build/login node).
# Building needs the package registries (or the mirrors this host's pip uses), never the compute
# nodes: copy OUT.sif to shared storage and pass it to `hpcrlhf sbatch/submit --container`.
# Environment: DEBIAN_MIRROR (cpu), CUDA_BASE (gpu, a docker image), HPCRLHF_APPTAINER_FAKEROOT=0|1
# (default: 1, except root without a /etc/subuid entry), TMPDIR (the staging folder).
set -euo pipefail
usage() { sed -n '3,4p' "$0" | sed 's/^# *//' >&2; exit 2; }
[ $# -ge 2 ] || usage
flavour=$1 out=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd); repo=$(dirname "$here")
case $flavour in
  cpu) constraints=$repo/constraints.txt; args=(--build-arg "MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}") ;;
  gpu) constraints=$here/constraints-gpu.txt; args=(--build-arg "BASE=${CUDA_BASE:-nvidia/cuda:12.9.1-cudnn-devel-ubuntu24.04}") ;;
  *) echo "build.sh: flavour '$flavour' is invalid: use cpu or gpu" >&2; exit 2 ;;
esac
command -v apptainer >/dev/null || { echo "build.sh: apptainer not found: install Apptainer >= 1.2 (apptainer/README.md)" >&2; exit 2; }
out_dir=$(dirname "$out"); [ -d "$out_dir" ] && [ -w "$out_dir" ] || { echo "build.sh: cannot write $out: its folder is missing or read-only" >&2; exit 2; }

# The build context: hpcrlhf's source, the pinned versions, the install step and this host's pip settings.
stage=$(mktemp -d "${TMPDIR:-/tmp}/hpcrlhf-image.XXXXXX"); trap 'rm -rf "$stage"' EXIT
mkdir "$stage/src"
(cd "$repo" && tar --exclude=__pycache__ -cf - hpcrlhf setup.cfg pyproject.toml README.md) | tar -xf - -C "$stage/src"
cp "$constraints" "$stage/constraints.txt"
cp "$here/install-python-stack.sh" "$stage/"
binds=$(python3 "$here/pip_settings.py" "$stage/pip.conf")
tr ',' '\n' <<< "$binds" | cut -d: -f2 | sed '/^$/d' > "$stage/mount-points"
chmod -R a+rX "$stage"

fakeroot=${HPCRLHF_APPTAINER_FAKEROOT:-}
if [ -z "$fakeroot" ]; then
  fakeroot=1; [ "$(id -u)" = 0 ] && ! grep -q '^root:' /etc/subuid 2>/dev/null && fakeroot=0
fi
[ "$fakeroot" = 1 ] && args+=(--fakeroot)
[ -n "$binds" ] && args+=(--bind "$binds")
echo "build.sh: building $out ($flavour) from $here/hpcrlhf-$flavour.def"
start=$(date +%s)
apptainer build --force "${args[@]}" --build-arg "STAGE=$stage" "$@" "$out" "$here/hpcrlhf-$flavour.def"
echo "build.sh: built $out in $(( $(date +%s) - start )) s ($(du -h "$out" | cut -f1)); check it: apptainer test $out"
