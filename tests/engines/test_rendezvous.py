"""Issue 36 item 3: the stores where a process group's ranks meet (hpcrlhf.engines.rendezvous) listen
on one address and a port of the job's block, and are useless to a client without the group's
secret: it sees opaque key names and sealed values, and what it writes is refused by the members.
(torch's own TCPStore listens on every interface, and any client could list and read its keys.)"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch.distributed as dist

from hpcrlhf.engines import rendezvous
from hpcrlhf.engines.rendezvous import ForeignValue
from hpcrlhf.engines.store_ports import STORE_PORTS_ENV
from hpcrlhf.errors import HpcrlhfError


def listeners(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def free_range(host: str, size: int) -> range:
    from hpcrlhf.cluster.local import free_port_block

    first = free_port_block(size, start=40000, host=host)
    return range(first, first + size)


def plain_client(meeting) -> dist.TCPStore:
    """A client of the store that knows its address but not the group's secret."""
    return dist.TCPStore(meeting.host, meeting.port, None, False, datetime.timedelta(seconds=10))


def test_a_store_listens_on_its_address_only_on_a_port_of_the_jobs_block(monkeypatch):
    ports = free_range("127.0.0.9", 3)
    monkeypatch.setenv(STORE_PORTS_ENV, f"{ports.start}-{ports.stop - 1}")
    store, meeting = rendezvous.serve("127.0.0.9", 30)
    assert (meeting.host, meeting.port) == ("127.0.0.9", ports.start)
    assert ("127.0.0.9", ports.start) in listeners(os.getpid())
    assert not [a for a in listeners(os.getpid()) if a[1] == ports.start and a[0] != "127.0.0.9"]
    assert meeting.secret not in repr(meeting)  # logs never show it
    second, at = rendezvous.serve("127.0.0.9", 30)  # the next free one
    assert at.port == ports.start + 1
    local, here = rendezvous.serve("127.0.0.9", 30, local=True)  # a process's own workers: loopback, no block port
    assert here.host == "127.0.0.1" and here.port not in ports


def test_a_full_share_of_the_block_is_a_clear_error(monkeypatch):
    ports = free_range("127.0.0.9", 1)
    monkeypatch.setenv(STORE_PORTS_ENV, f"{ports.start}-{ports.start}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.9", ports.start))
        taken.listen()
        with pytest.raises(HpcrlhfError, match=f"every port of this node's share of the job's block "
                                               f"\\({ports.start}-{ports.start}, {STORE_PORTS_ENV}\\) is in use"):
            rendezvous.serve("127.0.0.9", 30)


def test_a_client_without_the_secret_reads_nothing_and_what_it_writes_is_refused():
    store, meeting = rendezvous.serve("127.0.0.1", 30)
    member = rendezvous.connect(meeting, 30)
    store.set("device/0", "cpu")
    member.set("addr/1", "127.0.0.1:41234")
    assert member.get("device/0") == b"cpu" and store.get("addr/1") == b"127.0.0.1:41234"
    spy = plain_client(meeting)
    names = spy.list_keys()
    assert len(names) == 2 and all(len(n) == 64 and "/" not in n for n in names), names  # HMACs, not the names
    for name in names:
        value = spy.get(name)
        assert b"cpu" not in value and b"127.0.0.1" not in value, value
    assert not spy.check(["device/0"])  # the plain names do not exist
    spy.set(names[0], b"127.0.0.1:6666")  # overwrite a member's value
    spy.set(store._name("device/1"), b"cpu")  # even under the right name (which it could not know)
    with pytest.raises(ForeignValue, match="was not written by a member of the group"):
        [member.get(k) for k in ("device/0", "addr/1")]
    with pytest.raises(ForeignValue, match="'device/1'"):
        member.get("device/1")


def test_a_world_of_one_listens_on_nothing_but_loopback():
    """A single process's group (the driver, a one-process run): its store in memory, gloo's devices on
    loopback, DeepSpeed's clone of the world group's too. (torch's env:// store listened on every
    interface.) Gloo's default is the host name's address, loopback on some hosts (as here): the
    interface it is told to use is checked too. (DeepSpeed's comm is attached as the trainers attach it: a plain
    `deepspeed.init_distributed` JIT-builds a shared-memory op under torch's lock file, which hung a CI run for
    300 s.)"""
    code = textwrap.dedent("""
        import faulthandler, os, psutil
        faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where, before the timeout below
        from deepspeed.utils import groups
        from hpcrlhf.engines.deepspeed_engine import ensure_deepspeed_comm
        from hpcrlhf.engines.distributed import init_distributed
        init_distributed()
        ensure_deepspeed_comm()  # DeepSpeed's comm on the group, as every hpcrlhf rank attaches it
        groups._clone_world_group()
        print(os.environ["GLOO_SOCKET_IFNAME"],
              sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}))
    """)
    unset = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "GLOO_SOCKET_IFNAME")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "lo ['127.0.0.1']", out.stdout
