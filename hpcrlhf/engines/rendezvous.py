"""Where the ranks of a process group meet: a torch.distributed `TCPStore` served by one member and
reached by the others -- bound to one address, on a port of the job's block, and sealed with a
secret of the group.

torch's `TCPStore` has no authentication, and its server listens on every interface of the host
whatever address it is given (torch 2.13: `*:PORT`), on a port the system picks: anyone who can
reach the host can connect, list the keys (`list_keys`) and read or overwrite them. A store served
here instead:

- listens on the one address its members use: a socket bound to it is handed to the store
  (`master_listen_fd`, as vLLM does since its StatelessProcessGroup fix) -- the node's address for
  groups that span nodes, 127.0.0.1 for a process and its own vLLM workers (`local`);
- takes its port from the node's share of the job's port block (STORE_PORTS_ENV, set by the
  `ray start` hpcrlhf runs: the ports after Ray's in `RayPorts`), so two jobs on a node never
  collide and nothing outside the job's block listens beyond loopback; where the variable is not
  set (a Ray cluster the user started) or for a `local` store, a port the system picks;
- is useless without the group's secret: every key name is replaced by an HMAC of it and every
  value is encrypted and authenticated (AES-SIV: deterministic, so `compare_set` still works); a
  value a member reads that was not sealed with the secret is refused (`ForeignValue`). The
  secret (64 random bytes, one per group) is made by the member that serves the store and reaches
  the others over Ray's token-authenticated calls (or MPI, or the launcher's environment).

What anyone who can reach the port still can do: connect, count the keys, see their opaque names
and the sizes of their sealed values, delete or overwrite them (the group's members then stop with
`ForeignValue` or a timeout: a denial of service, not a way in). Counters (`add`) hold plain
numbers, as the server adds them. The collectives' own connections (gloo's pairs, NCCL's
bootstrap) are torch's and NCCL's: they listen on the address the host name resolves to (or
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), on ports the system picks, without authentication --
torch has no setting to change that; the addresses and ids they exchange travel sealed here.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
from dataclasses import dataclass

import torch.distributed as dist

from hpcrlhf.engines.store_ports import STORE_PORTS_ENV, ports_text, store_ports
from hpcrlhf.errors import HpcrlhfError

SECRET_BYTES = 64
"""An AES-256-SIV key (two 256-bit halves)."""


class ForeignValue(HpcrlhfError):
    """A value in a group's store was not written by a member: someone without the group's secret
    wrote or replaced it."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a group meets and the secret that opens its store (hex; passed to members only over
    authenticated channels, never logged: `repr` hides it)."""

    host: str
    port: int
    secret: str

    def __repr__(self) -> str:
        return f"Rendezvous({self.host}:{self.port})"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def listen(host: str, ports: range | None) -> socket.socket:
    """A listening TCP socket bound to `host` only, on the first free port of `ports` (any port the
    system picks when None). Kept open until the store takes it: no other process can take the
    port in between."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    for port in ports if ports is not None else [0]:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past connections in TIME_WAIT do not block it
        try:
            sock.bind((host, port))
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as e:
            sock.close()
            if ports is None:
                raise HpcrlhfError(f"cannot listen on {host} for a rendezvous store or reward server: {e.strerror or e}") from None
    raise HpcrlhfError(f"no free port for a rendezvous store or reward server on {host}: every port of this node's share of the job's "
                       f"block ({ports_text(ports)}, {STORE_PORTS_ENV}) is in use -- by this job's other groups, or "
                       "another program took them; rerun the job")


def node_address(host: str) -> str:
    """`host` as an IP address (a host name resolved): what a socket binds to."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return socket.gethostbyname(host)


def serve(host: str, timeout_s: float, *, local: bool = False) -> tuple[SealedStore, Rendezvous]:
    """Serve a new group's store on `host` (this process is the group's rank 0): the sealed store and
    the rendezvous the other members need. `local`: a store for processes of this host only, on
    127.0.0.1 and a port the system picks (it takes no port of the job's block)."""
    host = "127.0.0.1" if local else node_address(host)
    sock = listen(host, None if local else store_ports())
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        store = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise
    meeting = Rendezvous(host, port, secrets.token_hex(SECRET_BYTES))
    return SealedStore(store, meeting), meeting


def connect(meeting: Rendezvous, timeout_s: float) -> SealedStore:
    """A member's handle on the store of `meeting` (waits up to `timeout_s` for it to answer)."""
    store = dist.TCPStore(meeting.host, meeting.port, None, False, datetime.timedelta(seconds=timeout_s))
    return SealedStore(store, meeting)


def member_store(meeting: Rendezvous, rank: int, store: SealedStore | None, timeout_s: float) -> SealedStore:
    """The store a member uses: `store` where given (rank 0's, which it serves), else a connection to
    the one at `meeting` (rank 0 must pass its own)."""
    if store is not None:
        return store
    if rank == 0:
        raise RuntimeError("rank 0 serves the group's store: call `serve` first and pass the store it returns")
    return connect(meeting, timeout_s)


SECRET_ENV = "HPCRLHF_STORE_SECRET"
"""The secret of the default group's store, where hpcrlhf's launcher made one (the MPI launcher:
rank 0's, broadcast over MPI)."""


def launched_store(rank: int, timeout_s: float) -> dist.Store:
    """The default group's store for ranks started with MASTER_ADDR and MASTER_PORT (hpcrlhf's MPI
    launcher, `hpcrlhf submit`'s tasks): rank 0 serves it on MASTER_ADDR only (torch's env:// store
    would listen on every interface), the others connect; sealed where the launcher gave a secret
    (SECRET_ENV). Under torchrun, whose agent serves the store, torch's env:// is used instead."""
    host, port = node_address(os.environ["MASTER_ADDR"]), int(os.environ["MASTER_PORT"])
    secret = os.environ.get(SECRET_ENV)
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        fd = listen(host, range(port, port + 1)).detach()
        try:
            store = dist.TCPStore(host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise
    else:
        store = dist.TCPStore(host, port, None, False, timeout)
    return SealedStore(store, Rendezvous(host, port, secret)) if secret else store


def local_store() -> dist.Store:
    """The store of a world of one: in this process's memory, nothing listens."""
    return dist.HashStore()


class SealedStore(dist.Store):
    """A store's keys and values sealed with a group's secret (see the module docstring). Wraps the
    `TCPStore` (kept alive with it); torch and gloo use it like any store.

    Keep a reference to it for as long as a process group uses it (the group's owner does): torch
    holds only its C++ half, and once the Python object is gone its methods cannot be found ("fn
    INTERNAL ASSERT FAILED ... Not implemented"). Its clones are kept by it for the same reason."""

    def __init__(self, inner: dist.Store, meeting: Rendezvous) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESSIV

        super().__init__()
        key = bytes.fromhex(meeting.secret)
        self.inner, self.meeting, self.where = inner, meeting, meeting.address
        self.clones: list[SealedStore] = []
        self._siv = AESSIV(key)
        self._names = hmac.new(key, b"hpcrlhf rendezvous key names", hashlib.sha256).digest()

    def _name(self, key: str) -> str:
        return hmac.new(self._names, key.encode(), hashlib.sha256).hexdigest()

    def _seal(self, key: str, value) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        return self._siv.encrypt(data, [key.encode()])  # the key bound in: a value cannot be moved to another key

    def _open(self, key: str, sealed: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        try:
            return self._siv.decrypt(bytes(sealed), [key.encode()])
        except InvalidTag:
            raise ForeignValue(f"the value of key {key!r} in the process group's store at {self.where} was not "
                               "written by a member of the group (someone without the group's secret wrote or "
                               "replaced it): the group cannot go on; rerun the job") from None

    def clone(self) -> SealedStore:
        """Another connection to the same store, sealed alike (torch may ask for one per new group)."""
        clone = SealedStore(self.inner.clone(), self.meeting)
        self.clones.append(clone)
        return clone

    def set(self, key: str, value) -> None:
        self.inner.set(self._name(key), self._seal(key, value))

    def get(self, key: str) -> bytes:
        return self._open(key, self.inner.get(self._name(key)))

    def compare_set(self, key: str, expected, desired) -> bytes:
        # empty `expected`: set only where the key is missing (torch's convention), so it stays empty
        sealed_expected = self._seal(key, expected) if len(expected) else b""
        current = self.inner.compare_set(self._name(key), sealed_expected, self._seal(key, desired))
        return self._open(key, current) if len(current) else b""

    def add(self, key: str, value: int) -> int:
        return self.inner.add(self._name(key), value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        names = [self._name(k) for k in keys]
        if timeout is None:
            self.inner.wait(names)
        else:
            self.inner.wait(names, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check([self._name(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self._name(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)
