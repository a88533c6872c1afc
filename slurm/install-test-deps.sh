#!/usr/bin/env bash
# System packages the Slurm and MPI tests start for real (Debian/Ubuntu): Slurm (controller, node
# daemon, accounting daemon + MariaDB for it, clients), munge, Open MPI; and ccache, which torch puts
# before the compiler of DeepSpeed's JIT ops (cpu_adam) when it is on PATH: a fresh venv's headers
# have new mtimes, so ninja rebuilds the op in every CI run (~110 s of 2 cores), and ccache answers it
# from ~/.cache/ccache (~9 s) where the paths are the same. Idempotent. Without root or apt-get it
# installs nothing and says which tests will skip.
set -euo pipefail
PKGS="munge slurm-wlm slurmctld slurmd slurm-client slurmdbd mariadb-server openmpi-bin libopenmpi-dev ccache"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -z "$missing" ]; then
  echo "slurm/install-test-deps.sh: all present"
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "slurm/install-test-deps.sh: missing:$missing -- the Slurm/MPI tests will skip (run this script as root to install)"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq $missing >/dev/null
echo "slurm/install-test-deps.sh: installed$missing"
