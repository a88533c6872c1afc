"""The ports a node's rendezvous stores may use: the environment variable that names them, its
`FIRST-LAST` form, and reading it back.

The node's `ray start` (hpcrlhf.cluster.bootstrap) sets the variable to its share of the job's port
block and its workers inherit it; a store (hpcrlhf.engines.rendezvous) listens on one of those
ports. Apart from rendezvous.py, which needs torch, so that rendering `ray start` (`hpcrlhf sbatch`
on a login node) sets it without importing torch, and the cluster layer imports the engines' name
rather than the engines importing the cluster's.
"""

from __future__ import annotations

import os

from hpcrlhf.errors import HpcrlhfError

NODE_SERVICE_PORTS = 20
"""Ports of each node's share of the job's block for the job's own listeners: its rendezvous stores
and its reward servers (`reward.sources[i].servers`)."""
MAX_SERVERS_PER_NODE = 10
"""The most reward servers one node may run: the other half of NODE_SERVICE_PORTS stays for the stores."""
STORE_PORTS_ENV = "HPCRLHF_STORE_PORTS"
"""`FIRST-LAST`: the ports of this node's share of the job's block that the job's stores may use
(hpcrlhf.engines.rendezvous), in the environment of the node's `ray start`, which its workers inherit."""


def ports_text(ports: range) -> str:
    """`FIRST-LAST`, the form of STORE_PORTS_ENV."""
    return f"{ports.start}-{ports.stop - 1}"


def store_ports(environ: dict[str, str] | None = None) -> range | None:
    """This node's ports for rendezvous stores (STORE_PORTS_ENV), or None where none are set."""
    value = (os.environ if environ is None else environ).get(STORE_PORTS_ENV)
    if not value:
        return None
    try:
        first, last = (int(p) for p in value.split("-"))
    except ValueError:
        raise HpcrlhfError(f"{STORE_PORTS_ENV}={value!r}: expected FIRST-LAST (two port numbers)") from None
    if not 0 < first <= last < 65536:
        raise HpcrlhfError(f"{STORE_PORTS_ENV}={value!r}: expected FIRST-LAST with 0 < FIRST <= LAST < 65536")
    return range(first, last + 1)
