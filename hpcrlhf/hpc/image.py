"""Apptainer images: checked before a job is written or queued, and a smoke test run inside one.

`check_image(path, python)` (submission host): the image exists, is a readable SIF file, and --
when `apptainer` is on this host -- its `python` imports hpcrlhf. Any failure is a `ConfigError`
naming `--container`, the path and the fix, raised before anything is written or queued.

`python -m hpcrlhf.hpc.image selftest` (inside an image; the images' `%test`, so `apptainer test
IMAGE` runs it): the whole stack imports, a tiny model is built and generates, and hpcrlhf's
console script is on PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hpcrlhf import __version__
from hpcrlhf.errors import ConfigError

SIF_MAGIC = b"SIF_MAGIC"
"""Bytes 32..41 of every SIF file (Apptainer's Singularity Image Format header)."""
STACK = ("torch", "transformers", "datasets", "deepspeed", "ray", "vllm", "submitit", "mpi4py", "hpcrlhf")
BUILD_HINT = "build one with `apptainer/build.sh cpu|gpu OUT.sif` (apptainer/README.md)"


def unusable(path: str, why: str) -> ConfigError:
    return ConfigError(f"--container: {path!r} cannot be used: {why}")


def image_problem(path: str) -> str | None:
    """Why `path` cannot be a job's image (None: it is a readable SIF file)."""
    p = Path(path)
    if not p.is_absolute():
        return "it is a relative path: give an absolute path on shared storage the compute nodes can read"
    if not p.exists():
        return f"no such file: {BUILD_HINT}, or fix the path"
    if not p.is_file():
        return "it is not a file (a sandbox folder?): give a .sif image file"
    if not os.access(p, os.R_OK):
        return "it is not readable by you: `chmod a+r` it (images on shared storage must be readable by the job)"
    with open(p, "rb") as f:
        head = f.read(64)
    if SIF_MAGIC not in head:
        return f"it is not a SIF image (no SIF header; truncated or another format?): {BUILD_HINT}"
    return None


def probe_hpcrlhf(path: str, python: str = "python", apptainer: str = "apptainer") -> str:
    """The hpcrlhf version inside the image (raises ConfigError when its `python` cannot import it)."""
    cmd = [apptainer, "exec", path, python, "-c", "import hpcrlhf; print(hpcrlhf.__version__)"]
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise unusable(path, f"its `{python}` cannot import hpcrlhf ({last}): {BUILD_HINT}, or name the image's "
                             "Python with --python")
    return proc.stdout.strip().splitlines()[-1]


def check_image(path: str, python: str = "python") -> list[str]:
    """Raise ConfigError unless `path` is a usable image; returns notes for the user."""
    problem = image_problem(path)
    if problem:
        raise unusable(path, problem)
    if shutil.which("apptainer") is None:
        return [f"apptainer is not on this host: the job checks that {path} holds hpcrlhf when it starts"]
    inside = probe_hpcrlhf(path, python)
    if inside != __version__:
        return [f"the image holds hpcrlhf {inside}, this host {__version__}: the job runs the image's; "
                "rebuild the image if the job needs this version's options"]
    return []


def selftest() -> int:
    """Smoke test of an image: imports, a tiny model that generates, the CLI on PATH."""
    import importlib

    for name in STACK:
        module = importlib.import_module(name)
        print(f"selftest: {name} {getattr(module, '__version__', '')}", flush=True)
    if shutil.which("hpcrlhf") is None:
        print("selftest: FAILED: the `hpcrlhf` console script is not on PATH", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as cache:
        os.environ["HPCRLHF_CACHE"] = cache
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from hpcrlhf.models.tiny import build_tiny_model_dir  # torch, transformers (as above)

        folder = build_tiny_model_dir("llama")
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder))
        ids = tokenizer("12+34=", return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, do_sample=False)
        if out.shape[1] <= ids.shape[1]:
            print("selftest: FAILED: the tiny model generated nothing", file=sys.stderr)
            return 1
    print(f"selftest: passed (hpcrlhf console script: {shutil.which('hpcrlhf')}; "
          f"GPUs visible: {torch.cuda.device_count()})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv != ["selftest"]:
        print("usage: python -m hpcrlhf.hpc.image selftest", file=sys.stderr)
        return 2
    return selftest()


if __name__ == "__main__":
    sys.exit(main())
