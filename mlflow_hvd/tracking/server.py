"""What the driver and rank 0 both ask of the tracking server: can it be reached from
here, and what the run holds that a rank needs to know before training."""

from __future__ import annotations

import socket
import urllib.parse
from typing import Any

from mlflow_hvd.errors import TrackingError
from mlflow_hvd.messages import RunFacts

SERVER_CONNECT_TIMEOUT = 10.0  # seconds given to the tracking server to accept


def run_facts(run: Any) -> RunFacts:
    """What rank 0 would otherwise ask the server before training (see :class:`RunFacts`)."""
    from mlflow_hvd.tracking.checkpoints import LATEST_TAG

    tags = run.data.tags
    return RunFacts(
        params=dict(run.data.params),
        source_tags={k: v for k, v in tags.items() if k.startswith("mlflow.source.")},
        has_checkpoint=bool(tags.get(LATEST_TAG)),
    )


def check_server_reachable(uri: str, who: str, timeout: float = SERVER_CONNECT_TIMEOUT) -> None:
    """Fail fast when an HTTP tracking server cannot be reached from this host (MLflow's
    own client would retry with backoff for minutes). ``who``: "the driver", "rank 0 on
    host X"."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout).close()
    except OSError as exc:
        raise TrackingError(
            f"{who} cannot reach the MLflow tracking server {uri} within "
            f"{timeout:g}s: {exc}. Executors must reach MLFLOW_TRACKING_URI: use an address "
            "of the server that every node can connect to (not localhost), and open its port"
        ) from exc
