"""Addresses and routes of this machine, as the driver and the Spark tasks both need them:
the one home of every choice of an address (where the driver's servers listen, which source
address reaches a host, whether an address is this machine's)."""

from __future__ import annotations

import socket


def resolve_host(host: str) -> str:
    """IPv4 address of ``host`` (ranks and Gloo connect to the driver by address); ``host``
    itself if it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def route_source(address: str) -> str:
    """The local IPv4 address this machine sends from to reach ``address``: a UDP socket's
    ``connect`` picks the route and sends nothing.

    Raises:
        OSError: No route to ``address``.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return str(probe.getsockname()[0])


def is_local_address(host: str) -> bool:
    """True when ``host`` resolves to an address of this machine (one a socket can bind)."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    except (OSError, IndexError):
        return False
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((sockaddr[0], 0))
        except OSError:
            return False
    return True


def listen_address(host: str) -> str:
    """Where a driver server listens for peers that dial ``host``: ``host`` itself when it
    is an address of this machine (loopback for local ranks: nothing else reaches the port),
    else every interface (``""``: the address peers dial belongs to a NAT or a proxy in
    front of this machine). Every server of a generation listens where this says."""
    return host if is_local_address(host) else ""


def route_source_or_loopback(host: str) -> str:
    """The local IPv4 address this machine sends from to reach ``host``
    (:func:`route_source`); ``127.0.0.1`` for a loopback host, and also when ``host`` does
    not resolve or has no route (the caller then checks whether the server is on this
    machine)."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"
    if address.startswith("127."):
        return "127.0.0.1"
    try:
        return route_source(address)
    except OSError:
        return "127.0.0.1"
