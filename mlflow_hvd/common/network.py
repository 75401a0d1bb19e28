"""Addresses and routes of this machine, as the driver and the Spark tasks both need them."""

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
