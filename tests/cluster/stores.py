"""What a running job's processes listen on, and whether the stores of its process groups
(torch.distributed TCPStores: each role's group, the weight-sync group) are sealed in its port block
(issue 36, hpcrlhf.engines.rendezvous): on the node's address, on a store port of the job's block, no
key or value readable by a client without the group's secret, and nothing of the job listening on
every interface outside its block. They used to listen on every interface, on ports the system
picked, and any client could read their keys. Used by tests/cluster/test_security.py (a run on the
host's network) and tests/cluster/test_ppo.py (a Slurm job inside the image)."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from hpcrlhf.cluster.bootstrap import PORTS_PER_NODE, RayPorts

WILDCARDS = ("0.0.0.0", "::")
DEVICE = b"cpu"
"""What the members of a weight-sync group put into its store, besides gloo's addresses (every group's)."""
NOT_THE_JOBS = ("slurmd", "slurmstepd", "srun", "bash", "sh", "tee", "sleep")
"""Processes on a Slurm node that are Slurm's or a job script's, not hpcrlhf's."""


@dataclass
class Survey:
    """What a running job's processes listen on."""

    listeners: dict[str, set[tuple[str, int]]]
    """Process ('name pid') -> every (address, port) it listens on."""
    blocks: list[range]
    """Each node's block of ports (from the store ports its processes were given)."""
    stores: dict[tuple[str, int], list[tuple[str, bytes]]]
    """Every listener that answers a plain TCPStore client: its keys and values as that client reads them."""

    def in_block(self, port: int) -> bool:
        return any(port in block for block in self.blocks)


def node_blocks(pids) -> list[range]:
    """Each node's port block: the store ports in the environment of its processes are its last 20."""
    found = set()
    for pid in pids:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found |= {int(v.split(b"-")[1]) + 1 for v in env if v.startswith(b"HPCRLHF_STORE_PORTS=")}
    return [range(end - PORTS_PER_NODE, end) for end in sorted(found)]


def answers_as_store(host: str, port: int, timeout_s: float = 3.0) -> bool:
    """Whether a TCPStore listens at host:port: its handshake (VALIDATE with torch's magic number, then
    PING: the server echoes the nonce), spoken here with a socket timeout -- torch's own client can
    wait for minutes on a listener that takes the connection and never answers (gloo's)."""
    import struct

    nonce = os.getpid() & 0xFFFFFFFF
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(struct.pack("=BIBI", 0, 0x3C85F7CE, 13, nonce))  # QueryType VALIDATE, PING
            return sock.recv(4) == struct.pack("=I", nonce)
    except OSError:
        return False


def read_stores(where: list[tuple[str, int]]) -> dict[tuple[str, int], list[tuple[str, bytes]]]:
    """The keys and values a client without any secret reads from each TCPStore among `where`."""
    import datetime
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed import TCPStore

    with ThreadPoolExecutor(32) as pool:
        stores = [hp for hp, yes in zip(where, pool.map(lambda hp: answers_as_store(*hp), where)) if yes]
    found = {}
    for host, port in stores:
        client = TCPStore(host, port, None, False, datetime.timedelta(seconds=10))
        found[(host, port)] = [(name, client.get(name)) for name in client.list_keys()]
    return found


def survey(pids) -> Survey:
    import psutil

    listeners = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.name() not in NOT_THE_JOBS:
                listeners[f"{p.name()} {pid}"] = {(c.laddr.ip.removeprefix("::ffff:"), c.laddr.port)
                                                 for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    where = sorted({("127.0.0.1" if ip in WILDCARDS else ip, port) for socks in listeners.values() for ip, port in socks})
    return Survey(listeners, node_blocks(pids), read_stores(where))


def assert_stores_sealed_in_the_block(s: Survey, stores: int) -> None:
    """No listener on every interface outside the job's blocks; every store on one address and a store
    port of a block (at least `stores` of them), none with a readable key name or value."""
    open_outside = sorted((who, ip, port) for who, socks in s.listeners.items() for ip, port in socks
                          if ip in WILDCARDS and not s.in_block(port))
    assert not open_outside, f"listening on every interface outside the job's blocks {s.blocks}: {open_outside}"
    store_ports = [RayPorts.from_base(block.start).stores for block in s.blocks]
    on_store_ports = {(ip, port) for socks in s.listeners.values() for ip, port in socks
                      if any(port in ports for ports in store_ports)}
    assert set(s.stores) == on_store_ports, f"stores {sorted(s.stores)}; on the blocks' store ports {on_store_ports}"
    assert len(s.stores) >= stores, f"found {len(s.stores)} stores, expected {stores}: {sorted(s.stores)}"
    in_the_clear = [DEVICE, *(socket.inet_aton(ip) for socks in s.listeners.values() for ip, _ in socks
                              if ip not in WILDCARDS and ":" not in ip)]  # gloo's addresses, packed
    for (ip, port), keys in s.stores.items():
        assert ip not in WILDCARDS, (ip, port)
        assert keys and all(re.fullmatch("[0-9a-f]{64}", name) for name, _ in keys), (ip, port, keys)
        clear = [value for _, value in keys if any(word in value for word in in_the_clear)]
        assert not clear, f"the store at {ip}:{port} shows values in the clear: {clear}"
