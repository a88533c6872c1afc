#!/usr/bin/env bash
# Apptainer for the container tests on Debian 12 hosts (what CI runs on). Idempotent; without root
# or apt-get it installs nothing and says which tests will skip. On a cluster, use the site's
# Apptainer (or its packages: https://apptainer.org/docs/admin/main/installation.html) instead.
#
# Debian 12 has no apptainer package: this takes Debian sid's apptainer .deb from the same mirror,
# shims the two glibc-2.38 symbols it needs (shim/isoc23.c, built here), retargets its GLIBC_2.38
# version need (shim/retarget_ver.py), repacks and installs it. It also gives root a subordinate id
# range (so `apptainer build --fakeroot` works as root) and drops root's default capability set
# (containers where root lacks CAP_SYS_RESOURCE refuse the full set).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if command -v apptainer >/dev/null; then
  echo "apptainer/install-apptainer.sh: $(apptainer --version) present"; exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "apptainer/install-apptainer.sh: apptainer missing -- the container tests will skip (run this script as root to install)"
  exit 0
fi
w=$(mktemp -d /tmp/apptainer-install.XXXXXX); trap 'rm -rf "$w"' EXIT
mkdir -p "$w"/{lists/partial,cache/archives/partial}
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends squashfs-tools squashfuse fuse2fs uidmap containernetworking-plugins \
  libseccomp2 libsqlite3-0 e2fsprogs patchelf gcc libc6-dev debootstrap busybox-static >"$w/apt.log" 2>&1 \
  || { cat "$w/apt.log"; exit 1; }
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main" > "$w/sources.list"
apt_sid=(-o Dir::Etc::SourceList="$w/sources.list" -o Dir::Etc::SourceParts=/dev/null -o Dir::State::Lists="$w/lists"
         -o Dir::Cache="$w/cache")
apt-get "${apt_sid[@]}" update -qq
(cd "$w" && apt-get "${apt_sid[@]}" download -qq apptainer/sid 2>/dev/null)
cd "$w" && dpkg-deb -R apptainer_*.deb pkg
lib=usr/lib/x86_64-linux-gnu/apptainer
gcc -O2 -shared -fPIC -o "pkg/$lib/libisoc23shim.so" "$here/shim/isoc23.c"
for b in pkg/usr/bin/apptainer "pkg/$lib/bin/starter"; do
  patchelf --clear-symbol-version __isoc23_strtol --clear-symbol-version __isoc23_strtoul \
           --add-needed "/$lib/libisoc23shim.so" "$b"
  python3 "$here/shim/retarget_ver.py" "$b" GLIBC_2.38 GLIBC_2.2.5 >/dev/null
done
sed -i 's/libc6 (>= 2.38)/libc6 (>= 2.36)/; s/^Version: \(.*\)/Version: \1+bookworm.shim1/' pkg/DEBIAN/control
dpkg-deb -Znone -b pkg apptainer-bookworm.deb >/dev/null
apt-get install -y -qq ./apptainer-bookworm.deb >"$w/apt2.log" 2>&1 || { cat "$w/apt2.log"; exit 1; }
sed -i 's/^root default capabilities = full/root default capabilities = no/' /etc/apptainer/apptainer.conf
for f in /etc/subuid /etc/subgid; do grep -q '^root:' "$f" 2>/dev/null || echo "root:200000:65536" >> "$f"; done
echo "apptainer/install-apptainer.sh: installed $(apptainer --version)"
