"""What the driver and rank 0 both ask of the tracking store: can it be reached from here,
is an error an outage (retry later) or a refusal, what the run holds that a rank needs to
know before training, and whether this host sees the run's artifact directory when that is
a path on the driver's disk."""

from __future__ import annotations

import os
import socket
import sys
import urllib.parse
from typing import Any

from mlflow_hvd.errors import TrackingError
from mlflow_hvd.protocol.messages import RunFacts

SERVER_CONNECT_TIMEOUT = 10.0  # seconds given to the tracking server to accept
_OUTAGE_CODES = {"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED",
                 "DEADLINE_EXCEEDED", "ABORTED"}


def is_outage(exc: BaseException) -> bool:
    """True for errors that mean "the server is unreachable or overloaded" (retry later),
    False for a refusal (a bad request, an inactive run: retrying cannot help)."""
    if isinstance(exc, OSError | TimeoutError):
        return True
    errors = sys.modules.get("mlflow.exceptions")  # an MLflow error means MLflow is loaded
    return (errors is not None and isinstance(exc, errors.MlflowException)
            and exc.error_code in _OUTAGE_CODES)


def run_facts(run: Any) -> RunFacts:
    """What rank 0 would otherwise ask the server before training (see :class:`RunFacts`)."""
    from mlflow_hvd.protocol.checkpoint_layout import LATEST_TAG

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


def make_local_artifact_dir(artifact_uri: str) -> str:
    """Driver: create the run's artifact directory if it is an absolute local path (a
    ``sqlite:`` or ``file:`` store's default) and return it; "" for any other location."""
    parsed = urllib.parse.urlsplit(artifact_uri)
    if parsed.scheme not in ("", "file") or parsed.netloc not in ("", "localhost"):
        return ""
    path = urllib.parse.unquote(parsed.path)
    if not os.path.isabs(path):
        return ""
    os.makedirs(path, exist_ok=True)
    return path


def check_local_artifacts(path: str, who: str) -> None:
    """Rank 0: refuse to write artifacts to a local path this host does not see.

    MLflow would create the directory on this host's own disk and write there: the files
    would be lost to the run without a word.

    Raises:
        TrackingError: ``path`` (the run's artifact directory on the driver's disk) is not
            a directory on this host.
    """
    if path and not os.path.isdir(path):
        raise TrackingError(
            f"{who} cannot see the run's artifact directory {path}, which is on the driver's "
            "disk: artifacts (checkpoints, the model) would be written to this host's own disk "
            "and lost. Track to an MLflow server with proxied artifacts (mlflow server "
            "--serve-artifacts; MLFLOW_TRACKING_URI=http://...), or keep the store on a disk "
            "every node mounts at the same path"
        )
