"""Apptainer images for the container tests: hpcrlhf's CPU image (built once per digest of its
stack) and an image without hpcrlhf (busybox only, seconds to build).

The CPU image is keyed by what its *stack* is made of (the definition, the install step, the pinned
versions, hpcrlhf's requirements, and the selftest `apptainer test` runs), not by hpcrlhf's code: a
build is ~16 min alone (debootstrap, pip install of torch/vLLM/DeepSpeed/Ray, mksquashfs), which a
change to a trainer must not cost every test run. The tests run the checkout's hpcrlhf inside it
(`checkout_bind`: the checkout's package bound over the copy the image installed), so what they
test is this code on the image's stack; the image's own copy is what `image check` runs."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_INPUTS = ["apptainer/hpcrlhf-cpu.def", "apptainer/build.sh", "apptainer/install-python-stack.sh",
                "apptainer/pip_settings.py", "constraints.txt", "setup.cfg", "pyproject.toml",
                "hpcrlhf/hpc/image.py"]
CACHE = Path(os.environ.get("HPCRLHF_TEST_IMAGES", Path.home() / ".cache" / "hpcrlhf-tests"))


def unavailable_reason() -> str | None:
    if shutil.which("apptainer") is None:
        return "apptainer is not installed (run apptainer/install-apptainer.sh as root)"
    return None


def stack_digest() -> str:
    h = hashlib.sha256()
    for path in (ROOT / f for f in IMAGE_INPUTS):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


BUSY = 75
"""Exit status of a background build that found another process's build of the image under way."""


class ImageBuild:
    """A build of the CPU image of the current stack running in the background (apptainer/build.sh,
    ~16 min alone, most of an hour beside the tests): started as soon as the session knows a test
    will need the image, so that the build overlaps the tests that run before it; `wait()` gives
    the image.

    Several test processes (pytest-xdist workers) may each start one: the build holds a lock on
    the cache for its whole run and moves the finished image into place itself, so one of them
    builds and the others, finding the lock taken, wait for it in `wait()`."""

    def __init__(self, image: Path):
        CACHE.mkdir(parents=True, exist_ok=True)
        self.image, self.log, self.lock = image, CACHE / "build.log", CACHE / "build.lock"
        partial = image.with_suffix(".partial.sif")
        self.started = time.monotonic()
        # fast compression: the test image is read a few times, then rebuilt when the stack changes.
        # One image kept (they are 1.3 GB each); the log is written only by the holder of the lock.
        script = (f'exec > "{self.log}" 2>&1; [ -e "{image}" ] && exit 0; '
                  f'find "{CACHE}" -maxdepth 1 -name "hpcrlhf-cpu-*.sif" -delete; '
                  f'bash "{ROOT / "apptainer" / "build.sh"}" cpu "{partial}" --mksquashfs-args "-Xcompression-level 1" '
                  f'&& mv "{partial}" "{image}"')
        self.proc = subprocess.Popen(["flock", "-n", "-E", str(BUSY), str(self.lock), "bash", "-c", script],
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait(self, timeout_s: float = 1800) -> Path:
        def left() -> float:
            return max(1.0, timeout_s - (time.monotonic() - self.started))

        try:
            status = self.proc.wait(timeout=left())
            if status == BUSY:  # another process builds it: its end releases the lock
                status = subprocess.run(["flock", str(self.lock), "true"], timeout=left()).returncode
        except subprocess.TimeoutExpired as timeout:
            self.stop()
            raise AssertionError(
                f"apptainer/build.sh cpu ran past {timeout_s:.0f} s:\n{self.log.read_text()[-6000:]}") from timeout
        if status != 0 or not self.image.exists():
            raise AssertionError(f"apptainer/build.sh cpu failed ({status}):\n{self.log.read_text()[-6000:]}")
        return self.image

    def stop(self) -> None:
        """End a build still running (the session ended before a test needed the image)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


_build: ImageBuild | None = None


def start_cpu_image_build() -> None:
    """Start building the CPU image of the current stack in the background, unless it is cached
    or already being built."""
    global _build
    image = CACHE / f"hpcrlhf-cpu-{stack_digest()}.sif"
    if _build is None and not image.exists():
        _build = ImageBuild(image)


def stop_cpu_image_build(*, needed_elsewhere: bool = False) -> None:
    """End this process's background build, or, where another test process may still need the
    image (`needed_elsewhere`: a pytest-xdist worker done with its share), let it finish first."""
    if _build is None:
        return
    if needed_elsewhere:
        try:
            _build.wait()
            return
        except AssertionError:  # its failure is reported by the test that needs the image
            pass
    _build.stop()


def build_cpu_image() -> Path:
    """The CPU image of the current stack (built by apptainer/build.sh unless already cached; a
    background build started by `start_cpu_image_build` is waited for)."""
    image = CACHE / f"hpcrlhf-cpu-{stack_digest()}.sif"
    if image.exists():
        return image
    start_cpu_image_build()
    assert _build is not None
    return _build.wait()


def checkout_bind(image: Path) -> str:
    """`SRC:DST` that binds the checkout's hpcrlhf package over the copy installed in `image` (where
    the image's Python imports it from, asked once)."""
    # -I: the image's own sys.path only (not the current folder, which apptainer binds: from a checkout that
    # would find the checkout's package, and the bind would then cover nothing)
    proc = subprocess.run(["apptainer", "exec", str(image), "python", "-I", "-c",
                           "import hpcrlhf, os; print(os.path.dirname(hpcrlhf.__file__))"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 0, f"{image} cannot import hpcrlhf: {proc.stderr[-2000:]}"
    return f"{ROOT / 'hpcrlhf'}:{proc.stdout.strip().splitlines()[-1]}"


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
