"""Apptainer images for the container tests: hpcrlhf's CPU image (built once per source digest)
and an image without hpcrlhf (busybox only, seconds to build)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_INPUTS = ["apptainer/hpcrlhf-cpu.def", "apptainer/build.sh", "apptainer/install-python-stack.sh",
                "apptainer/pip_settings.py", "constraints.txt", "setup.cfg", "pyproject.toml", "README.md"]
CACHE = Path(os.environ.get("HPCRLHF_TEST_IMAGES", Path.home() / ".cache" / "hpcrlhf-tests"))


def unavailable_reason() -> str | None:
    if shutil.which("apptainer") is None:
        return "apptainer is not installed (run apptainer/install-apptainer.sh as root)"
    return None


def source_digest() -> str:
    h = hashlib.sha256()
    files = [ROOT / f for f in IMAGE_INPUTS]
    files += sorted(p for p in (ROOT / "hpcrlhf").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in files:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def build_cpu_image() -> Path:
    """The CPU image of the current sources (built by apptainer/build.sh unless already cached)."""
    image = CACHE / f"hpcrlhf-cpu-{source_digest()}.sif"
    if image.exists():
        return image
    CACHE.mkdir(parents=True, exist_ok=True)
    for old in CACHE.glob("hpcrlhf-cpu-*.sif"):
        old.unlink()  # one image kept: they are 1.3 GB each
    log = CACHE / "build.log"
    partial = image.with_suffix(".partial.sif")
    with open(log, "w") as sink:
        # fast compression: the test image is read a few times, then rebuilt for the next sources
        proc = subprocess.run(["bash", str(ROOT / "apptainer" / "build.sh"), "cpu", str(partial),
                               "--mksquashfs-args", "-Xcompression-level 1"], stdout=sink, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=1800)
    if proc.returncode != 0:
        raise AssertionError(f"apptainer/build.sh cpu failed ({proc.returncode}):\n{log.read_text()[-6000:]}")
    partial.rename(image)
    return image


def busybox_image(folder: Path) -> Path:
    """A valid SIF image without Python or hpcrlhf (a static busybox as its only program)."""
    busybox = shutil.which("busybox")
    assert busybox, "busybox-static is needed (apptainer/install-apptainer.sh installs it)"
    root = folder / "rootfs"
    (root / "bin").mkdir(parents=True)
    shutil.copy(busybox, root / "bin" / "busybox")
    for tool in ("sh", "ls", "cat", "echo"):
        (root / "bin" / tool).symlink_to("busybox")
    image = folder / "busybox.sif"
    subprocess.run(["apptainer", "build", "--force", str(image), str(root)], check=True, capture_output=True,
                   stdin=subprocess.DEVNULL, timeout=300)
    return image
