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


def is_http(uri: str) -> bool:
    return urllib.parse.urlsplit(uri).scheme in ("http", "https")


def refusal(exc: BaseException, who: str, uri: str) -> TrackingError | None:
    """A :class:`TrackingError` naming the setting to fix when ``exc`` is the tracking
    server refusing this client (credentials, permission, TLS), else None."""
    text = f"{type(exc).__name__}: {exc}"
    for cause in _chain(exc):
        text += f"\n{type(cause).__name__}: {cause}"
    code = getattr(exc, "error_code", "")
    if "CERTIFICATE_VERIFY_FAILED" in text or "SSLError" in text:
        detail = next((ln.strip() for ln in text.splitlines() if "certificate" in ln.lower()),
                      text.splitlines()[0])[:300]
        return TrackingError(
            f"{who} cannot verify the TLS certificate of the MLflow tracking server {uri} "
            f"({detail}). Set MLFLOW_TRACKING_SERVER_CERT_PATH on the driver to the CA bundle "
            "that signed it (rank 0 gets the file from the driver), or "
            "MLFLOW_TRACKING_INSECURE_TLS=true to skip verification"
        )
    if code == "UNAUTHENTICATED" or "error code 401" in text:
        return TrackingError(
            f"the MLflow tracking server {uri} refused the credentials of {who} (HTTP 401). "
            "Check MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
            "MLFLOW_TRACKING_TOKEN) in the driver's environment: rank 0 gets them from the "
            "driver"
        )
    if code == "PERMISSION_DENIED" or "error code 403" in text:
        return TrackingError(
            f"the MLflow tracking server {uri} does not let {who} write to the run (HTTP "
            "403): the user of MLFLOW_TRACKING_USERNAME (or MLFLOW_TRACKING_TOKEN) needs "
            "EDIT permission on the run's experiment"
        )
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cause = exc.__cause__ or exc.__context__
    while cause is not None and len(out) < 10:
        out.append(cause)
        cause = cause.__cause__ or cause.__context__
    return out


def check_authorized(client: Any, run_id: str, who: str, uri: str,
                     tag: tuple[str, str] | None = None) -> None:
    """Before training: this client may read the run, write to it (``tag``, when given) and
    reach its artifacts (listing them through the server's proxy, or in the store), with
    TLS verified. A refusal raises :class:`TrackingError` naming the setting; an outage
    passes (what is logged waits for the server).

    Raises:
        TrackingError: The server refused this client.
    """
    try:
        run = client.get_run(run_id)
        if tag is not None:
            client.set_tag(run_id, *tag)
        # the run's repository itself, not MlflowClient's per-run cache of it (a rank's
        # MLflow caches the job's own there, mlflow_hvd.rank.tracking.artifacts)
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        get_artifact_repository(run.info.artifact_uri, tracking_uri=uri).list_artifacts()
    except Exception as exc:
        refused = refusal(exc, who, uri)
        if refused is not None:
            raise refused from exc
        if not is_outage(exc):
            raise


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
