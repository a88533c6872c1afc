"""Carry this host's pip settings (index mirrors, find-links, certificates) into an image build.

    python3 pip_settings.py OUT.conf   -> writes OUT.conf ([global]) when pip has settings here, and
                                          prints the local paths they name (comma-separated), which
                                          the build binds read-only so the mirrors are reachable.
"""

import ast
import os
import subprocess
import sys
from urllib.parse import urlparse

KEYS = ("index-url", "extra-index-url", "find-links", "trusted-host", "cert", "timeout", "default-timeout")


def settings() -> dict[str, str]:
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    found: dict[str, str] = {}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        key = name.rpartition(".")[2]
        if sep and key in KEYS and name.split(".")[0] in ("global", "install", ":env:"):
            found[key] = ast.literal_eval(value)
    return found


def local_paths(found: dict[str, str]) -> list[str]:
    paths = []
    for key in ("index-url", "extra-index-url", "find-links", "cert"):
        for item in found.get(key, "").split():
            url = urlparse(item)
            path = url.path if url.scheme == "file" else item if not url.scheme else ""
            if key == "cert" or key.endswith("index-url"):  # a file index links its files beside it (../files)
                path = os.path.dirname(path.rstrip("/"))
            if path and os.path.exists(path):
                paths.append(os.path.realpath(path))
    return sorted(set(paths))


def main(out: str) -> None:
    found = settings()
    if found:
        with open(out, "w") as f:
            f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in found.items()))
    print(",".join(f"{p}:{p}:ro" for p in local_paths(found)))


if __name__ == "__main__":
    main(sys.argv[1])
