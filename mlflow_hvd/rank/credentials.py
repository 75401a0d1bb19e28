"""Rank 0: the driver's MLflow client settings, in this process only, for one job.

Asked for over the job's channel (:class:`~mlflow_hvd.protocol.messages.AskCredentials`),
set in this process's environment (where MLflow's client reads them) and taken away when
the job ends. Certificate files are written into the rank's private directory (0700, the
files 0600), which the rank's agent removes when the worker exits, however it exits.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from mlflow_hvd.protocol.channel import ChannelClient
from mlflow_hvd.protocol.credentials import ALL_VARS, Sealed, unseal
from mlflow_hvd.protocol.messages import AskCredentials

ANSWER_TIMEOUT = 60.0


@dataclass
class Applied:
    """What :func:`apply` changed, so that :func:`remove` can undo it."""

    previous: dict[str, str | None]
    files: list[str]


def fetch(client: ChannelClient, rank: int) -> Sealed | None:
    """The sealed settings the driver hands to rank 0, or None when it has none.

    Raises:
        ChannelError: The driver did not answer.
    """
    answer = client.request(AskCredentials(rank), ANSWER_TIMEOUT)
    return answer if isinstance(answer, Sealed) else None


def apply(secret: bytes, sealed: Sealed, directory: str) -> Applied:
    """Set the settings in this process's environment; certificate files go into
    ``directory`` (created private). Variables of MLflow's client that the driver did not
    set are removed for the job, so the rank's host environment cannot mix in."""
    credentials = unseal(secret, sealed)
    applied = Applied({k: os.environ.get(k) for k in ALL_VARS}, [])
    for name in ALL_VARS:
        os.environ.pop(name, None)
    for name, value in credentials.env:
        applied.previous.setdefault(name, os.environ.get(name))
        os.environ[name] = value
    if credentials.files:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    for name, data in credentials.files:
        path = os.path.join(directory, name.lower() + ".pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        applied.files.append(path)
        os.environ[name] = path
    return applied


def remove(applied: Applied | None) -> None:
    """Undo :func:`apply`: the environment as it was, the files gone."""
    if applied is None:
        return
    for path in applied.files:
        with contextlib.suppress(FileNotFoundError):  # gone with the rank's directory
            os.remove(path)
    for name, value in applied.previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
