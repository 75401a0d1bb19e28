"""A lightweight stand-in for the rendezvous a rank performs at ``hvd.init()``: the same HTTP
requests, in the same order and with the same body sizes, that horovod 0.28.1's Gloo
``HTTPStore`` sends to the driver's ``RendezvousServer`` -- without TensorFlow, so that
hundreds of ranks fit on one machine.

What one rank sends, per scope (recorded from real ``hvd.init()`` calls against the server):

1. ``PUT /<scope>/rank_<r>`` (2 bytes);
2. for every lower rank ``i``: ``GET /<scope>/rank_<i>`` until it exists;
3. ``PUT /<scope>/<r>``: its pair addresses, 136 bytes for each other rank of the scope;
4. for every other rank ``i``: ``GET /<scope>/<i>`` every 10 ms until it exists, then once
   more to read it (the store's ``wait`` then ``get``): each answer is that rank's whole
   address list;
5. ``DELETE /<scope>/<r>``, once gloo has connected every pair of ranks, which means every
   other rank has read this rank's addresses (here a directory of marker files on the one
   machine stands in for those connections: it sends nothing to the driver).

The scopes are ``global``, ``local_<host>`` and ``cross_<local rank>``, each once plain and
once with a ``_process_set_hash_<hash>`` suffix (horovod initialises the global process set
again). Every request is a new connection, retried 3 times 500 ms apart as horovod does.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

ADDRESS_BYTES = 136  # one gloo TCP pair address (sockaddr_storage + sequence number)
RETRIES = 3
RETRY_WAIT = 0.5
POLL = 0.010
BARRIER_POLL = 0.1  # hundreds of ranks listing a directory every 10 ms would eat the CPU
PROCESS_SET_SUFFIX = "_process_set_hash_0123456789abcdef"


class RendezvousFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Scope:
    name: str
    rank: int
    size: int


def scopes_from_env(ranks_per_host: int | None = None) -> list[Scope]:
    """The scopes this rank joins, from the HOROVOD_* variables the driver sets; with
    ``ranks_per_host``, as if the job's ranks were spread over hosts of that many ranks
    (what the driver serves for a real multi-host job)."""
    rank = int(os.environ["HOROVOD_RANK"])
    size = int(os.environ["HOROVOD_SIZE"])
    if ranks_per_host:
        hosts = -(-size // ranks_per_host)
        host, local_rank = divmod(rank, ranks_per_host)
        local_size = min(ranks_per_host, size - host * ranks_per_host)
        cross_size = sum(1 for h in range(hosts) if h * ranks_per_host + local_rank < size)
        # names the server has no size for (its sizes are those of the real layout)
        return [Scope("global", rank, size), Scope(f"sim_local_host{host}", local_rank,
                                                   local_size),
                Scope(f"sim_cross_{local_rank}", host, cross_size)]
    local_rank = int(os.environ["HOROVOD_LOCAL_RANK"])
    local_size = int(os.environ["HOROVOD_LOCAL_SIZE"])
    cross_rank = int(os.environ["HOROVOD_CROSS_RANK"])
    cross_size = int(os.environ["HOROVOD_CROSS_SIZE"])
    hostname = os.environ["HOROVOD_HOSTNAME"]
    return [Scope("global", rank, size), Scope(f"local_{hostname}", local_rank, local_size),
            Scope(f"cross_{local_rank}", cross_rank, cross_size)]


class Store:
    """horovod's HTTPStore, in Python: one connection per request."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.requests = 0

    def _request(self, method: str, path: str, body: bytes = b"") -> bytes | None:
        """One request on a new connection, read until the server closes it, as horovod's
        C++ client does (a raw socket: the server's cost is what is measured, so the
        client should cost little)."""
        error: Exception | None = None
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        for _ in range(RETRIES):
            try:
                with socket.create_connection((self.host, self.port), self.timeout) as sock:
                    sock.sendall(head + body)
                    chunks = []
                    while chunk := sock.recv(1 << 16):
                        chunks.append(chunk)
                response = b"".join(chunks)
                status = int(response[9:12])
                self.requests += 1
                if status == 200:
                    return response[response.index(b"\r\n\r\n") + 4:]
                if status == 404:
                    return None
                error = RendezvousFailed(f"{method} {path}: HTTP {status}")
            except (OSError, ValueError) as exc:
                error = exc
            time.sleep(RETRY_WAIT)
        raise RendezvousFailed(f"{method} {path} failed {RETRIES} times: {error}")

    def poll(self, path: str, timeout: float) -> bytes:
        """GET until the key exists (``timeout`` per key, as gloo's ``store.wait``)."""
        deadline = time.monotonic() + timeout
        while (value := self._request("GET", path)) is None:
            if time.monotonic() > deadline:
                raise RendezvousFailed(f"GET {path}: not there within the gloo timeout")
            time.sleep(POLL)
        return value

    def wait_get(self, path: str, timeout: float) -> bytes:
        """gloo's ``wait`` then ``get``: the key is read once more after it appeared."""
        self.poll(path, timeout)
        value = self._request("GET", path)
        if value is None:
            raise RendezvousFailed(f"GET {path}: gone right after it appeared")
        return value

    def join(self, scope: Scope, timeout: float, connected: Path) -> None:
        prefix = f"/{scope.name}/"
        self._request("PUT", f"{prefix}rank_{scope.rank}", b"\0\0")
        for i in range(scope.rank):
            self.poll(f"{prefix}rank_{i}", timeout)
        self._request("PUT", f"{prefix}{scope.rank}",
                      bytes(ADDRESS_BYTES * (scope.size - 1)))
        for i in range(scope.size):
            if i != scope.rank:
                value = self.wait_get(f"{prefix}{i}", timeout)
                if len(value) != ADDRESS_BYTES * (scope.size - 1):
                    raise RendezvousFailed(f"{prefix}{i}: {len(value)} bytes")
        _all_connected(connected / scope.name, scope, time.monotonic() + timeout)
        self._request("DELETE", f"{prefix}{scope.rank}")


def _all_connected(folder: Path, scope: Scope, deadline: float) -> None:
    """Stands in for gloo connecting its pairs: returns once every rank of the scope has
    read its peers' addresses."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(scope.rank)).touch()
    while len(os.listdir(folder)) < scope.size:
        if time.monotonic() > deadline:
            raise RendezvousFailed(f"{scope.name}: not every rank read the addresses in time")
        time.sleep(BARRIER_POLL)


def rendezvous(connected: str, ranks_per_host: int | None = None,
               timeout: float = 30.0) -> int:
    """Perform ``hvd.init()``'s rendezvous against the driver; returns the number of HTTP
    requests this rank sent. ``connected``: an empty directory shared by the job's ranks
    (they run on this machine). ``timeout``: per awaited key, as
    ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (default 30 s; large jobs raise it)."""
    store = Store(os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
                  int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]), timeout)
    scopes = scopes_from_env(ranks_per_host)
    for suffix in ("", PROCESS_SET_SUFFIX):
        for scope in scopes:
            store.join(Scope(scope.name + suffix, scope.rank, scope.size), timeout,
                       Path(connected))
    return store.requests
