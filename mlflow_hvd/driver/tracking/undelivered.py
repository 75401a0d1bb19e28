"""Driver side: tracking records that never reached the server, saved for replay.

A bundle is a directory ``<root>/<run_id>/``::

    bundle.json     {"run_id": ..., "tracking_uri": ...}
    records.jsonl   the records, in order (:mod:`mlflow_hvd.protocol.records`); artifact
                    records name files relative to the bundle
    files/...       the artifact files

Rank 0's leftovers (:class:`~mlflow_hvd.protocol.messages.UndeliveredTracking`) and the driver's own
bookkeeping that timed out (failure tags, ``error.txt``, the run's final status) are
appended to the same bundle. :func:`replay` sends it in order once the server is back and
removes it; sending a record twice is harmless, so a replay that fails half-way can be run
again. From a shell: ``python -m mlflow_hvd.tracking.replay <bundle directory>``.

The root is ``HorovodRunner(tracking=TrackingConfig(undelivered_dir=...))``, else
``MLFLOW_HVD_UNDELIVERED_DIR``,
else ``$XDG_STATE_HOME/mlflow_hvd/undelivered`` (``~/.local/state/...``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
from collections.abc import Iterable

from mlflow_hvd.common.deadline import DeadlineExceeded
from mlflow_hvd.common.tracking_server import is_outage
from mlflow_hvd.protocol import records as rec
from mlflow_hvd.protocol.messages import TrackingTarget, UndeliveredTracking

_lock = threading.Lock()
log = logging.getLogger(__name__)


def default_root() -> str:
    env = os.environ.get("MLFLOW_HVD_UNDELIVERED_DIR")
    if env:
        return env
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return os.path.join(state, "mlflow_hvd", "undelivered")


def bundle_dir(root: str, run_id: str) -> str:
    return os.path.join(root, run_id)


def save(
    root: str,
    run_id: str,
    tracking_uri: str,
    records: Iterable[rec.Record],
    files: Iterable[tuple[str, bytes]] = (),
) -> str:
    """Append ``records`` (artifact records naming keys of ``files``) to the run's bundle;
    returns the bundle's path."""
    path = bundle_dir(root, run_id)
    with _lock:
        os.makedirs(os.path.join(path, "files"), exist_ok=True)
        meta = os.path.join(path, "bundle.json")
        if not os.path.exists(meta):
            with open(meta, "w") as f:
                json.dump({"run_id": run_id, "tracking_uri": tracking_uri}, f)
        renamed: dict[str, str] = {}
        for key, data in files:
            n = len(os.listdir(os.path.join(path, "files")))
            rel = os.path.join("files", str(n), os.path.basename(key))
            os.makedirs(os.path.join(path, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(path, rel), "wb") as out:
                out.write(data)
            renamed[key] = rel
        lines = os.path.join(path, "records.jsonl")
        new = not os.path.exists(lines)
        with open(lines, "a") as out:
            if new:
                out.write(rec.header() + "\n")
            for r in records:
                if isinstance(r, rec.Artifact):
                    r = dataclasses.replace(r, path=renamed.get(r.path, r.path))
                out.write(rec.encode(r) + "\n")
    return path


def keep_or_warn(
    error: BaseException,
    root: str,
    target: TrackingTarget,
    doing: str,
    missing: str,
    records: Iterable[rec.Record],
    files: Iterable[tuple[str, bytes]],
    *,
    timeout: float,
    consequence: str = "",
) -> None:
    """The driver's answer to a tracking write that failed with ``error`` while ``doing``
    (what was ``missing`` is in ``records`` and ``files``, as :func:`save` takes them).

    An outage or a missed deadline (``timeout``) keeps them in the run's bundle and warns
    with the command that sends them; a store that refused them would refuse them again, so
    it is only warned about. Never raises the tracking error: the job's outcome stands.
    """
    if not isinstance(error, DeadlineExceeded) and not is_outage(error):
        log.warning("mlflow_hvd: the tracking store refused a write while %s (not recorded: "
                    "%s): %s", doing, missing, error)
        return
    why = (f"did not answer within {timeout:g}s" if isinstance(error, DeadlineExceeded)
           else f"failed ({error})")
    path = save(root, target.run_id, target.tracking_uri, records, files)
    log.warning("mlflow_hvd: the tracking server %s while %s; not recorded: %s%s. Saved in "
                "%s; send with: python -m mlflow_hvd.tracking.replay %s", why, doing,
                missing, consequence, path, path)


def save_message(root: str, message: UndeliveredTracking) -> str:
    return save(root, message.run_id, message.tracking_uri, message.records, message.files)


def load(path: str) -> tuple[dict[str, str], list[rec.Record]]:
    """A bundle's metadata and its records (artifact paths made absolute).

    Raises:
        OSError: The bundle's files cannot be read.
        ValueError: They are not a bundle, or of another format version.
    """
    with open(os.path.join(path, "bundle.json")) as f:
        meta = json.load(f)
    records: list[rec.Record] = []
    lines = os.path.join(path, "records.jsonl")
    with open(lines) as f:
        for n, line in enumerate(f):
            if not line.strip() or (n == 0 and rec.check_header(line, lines)):
                continue
            r = rec.decode(line)
            if isinstance(r, rec.Artifact):
                r = dataclasses.replace(r, path=os.path.join(path, r.path))
            records.append(r)
    return meta, records


def replay(path: str, tracking_uri: str | None = None) -> dict[str, int]:
    """Send a bundle's records in order to its run, then remove the bundle.

    Raises:
        Exception: The MLflow client's error if a call fails; the bundle is kept and the
            replay can be run again (records already sent are deduplicated by MLflow).
    """
    from mlflow import MlflowClient

    meta, records = load(path)
    client = MlflowClient(tracking_uri=tracking_uri or meta["tracking_uri"])
    i = 0
    while i < len(records):
        n = rec.next_batch(records[i:])
        rec.send(client, meta["run_id"], records[i : i + n])
        i += n
    shutil.rmtree(path)
    return rec.count(records)
