"""Driver side: who may talk to a job's servers that have no authentication of their own -
horovod's rendezvous (:mod:`.gloo_server`; its C++ Gloo client cannot send any) and
``torch.distributed``'s store (:mod:`.torch_store`; ``TCPStore`` has none) - both of which
every rank trusts for its peers' addresses.

One :class:`Admission` per generation of ranks, shared by both: loopback for a local job
(its servers listen on loopback only); for a Spark job nobody until the barrier tasks report
their layout, then the addresses of the layout's hosts (and every address of this machine
when a task runs here: a rank connecting to a local address may use any of them as its
source). Anyone else is refused before a byte of the job's is read or written, counted, and
named in the lifecycle log by the server that refused it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading

log = logging.getLogger(__name__)

LOOPBACK = frozenset({"127.0.0.1", "::1"})


def local_addresses() -> frozenset[str]:
    """Every address of this machine's interfaces, loopback included."""
    import psutil

    found = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
             for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
    return frozenset(found | LOOPBACK)


def host_addresses(hostnames: set[str]) -> frozenset[str]:
    """The addresses the ranks on ``hostnames`` connect from: each name's own addresses,
    and all of this machine's when one of them is here."""
    found: set[str] = set()
    for name in hostnames:
        try:
            found |= {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
        except OSError:
            log.warning("the job's host %s does not resolve; its ranks will be refused by "
                        "the rendezvous and the torch.distributed store", name)
    here = local_addresses()
    if found & here or any(ipaddress.ip_address(a).is_loopback for a in found):
        found |= here
    return frozenset(found)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    try:
        return bool(host) and ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


class Admission:
    """The addresses a generation's servers answer (see the module docstring). Thread-safe.

    Args:
        bind_host: Where the servers listen: loopback admits loopback, from the start and
            for good; any other address admits nobody until :meth:`admit_hosts`.
    """

    def __init__(self, bind_host: str) -> None:
        self._local = is_loopback(bind_host)
        self._addresses = LOOPBACK if self._local else frozenset()
        self._lock = threading.Lock()

    def admit_hosts(self, hostnames: set[str]) -> None:
        """The job's layout is known: admit its hosts' addresses (a local job keeps
        loopback)."""
        if self._local:
            return
        addresses = host_addresses(hostnames)
        with self._lock:
            self._addresses = addresses

    def __contains__(self, address: object) -> bool:
        with self._lock:
            return address in self._addresses
