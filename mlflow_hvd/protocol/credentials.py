"""The driver's MLflow client settings (credentials, TLS), handed to rank 0 only.

MLflow's client reads who it is from its environment: ``MLFLOW_TRACKING_USERNAME`` /
``MLFLOW_TRACKING_PASSWORD``, ``MLFLOW_TRACKING_TOKEN``, ``MLFLOW_TRACKING_INSECURE_TLS``,
and the paths ``MLFLOW_TRACKING_SERVER_CERT_PATH`` (a CA bundle) and
``MLFLOW_TRACKING_CLIENT_CERT_PATH``. Executors of a cluster do not have the driver's
environment, so the driver collects these (:func:`collect`; the files' contents, not their
paths) and rank 0 asks for them over the job's channel. They never go on a command line, in
Spark's configuration or in the payload staged on the executor's disk.

On the wire they are sealed (:func:`seal`): AES-256-GCM under a key derived from the job's
secret, which itself reached the executor inside the Spark task (encrypted where Spark's RPC
encryption is on). The channel's frames are signed, not encrypted: sealing keeps the
password off the network in the clear even on a cluster without RPC encryption.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mlflow_hvd.errors import ConfigurationError

ENV_VARS = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_INSECURE_TLS",
    "MLFLOW_TRACKING_AUTH",
)
FILE_VARS = ("MLFLOW_TRACKING_SERVER_CERT_PATH", "MLFLOW_TRACKING_CLIENT_CERT_PATH")
ALL_VARS = ENV_VARS + FILE_VARS
_KEY_LABEL = b"mlflow_hvd credentials v1"
_AAD = b"mlflow_hvd credentials"


@dataclass(frozen=True)
class Credentials:
    """Variables for rank 0's environment and files whose paths it sets (by variable)."""

    env: tuple[tuple[str, str], ...] = field(repr=False)
    files: tuple[tuple[str, bytes], ...] = field(repr=False)

    def __repr__(self) -> str:  # names only: never a value in a log or a traceback
        return f"Credentials({', '.join(self.names())})"

    def names(self) -> list[str]:
        return [k for k, _ in self.env] + [k for k, _ in self.files]


@dataclass(frozen=True)
class Sealed:
    """Credentials as they cross the channel: ``nonce`` and AES-GCM ciphertext."""

    nonce: bytes
    data: bytes = field(repr=False)


def collect(environ: Mapping[str, str], extra: Sequence[str] = ()) -> Credentials | None:
    """The MLflow client settings in ``environ`` (plus the variables named in ``extra``,
    e.g. an artifact store's), with the files the path variables name read in; None when
    there are none.

    Raises:
        ConfigurationError: A path variable names a file that cannot be read.
    """
    env = [(k, environ[k]) for k in (*ENV_VARS, *extra) if environ.get(k)]
    files = []
    for var in FILE_VARS:
        path = environ.get(var)
        if not path:
            continue
        try:
            with open(path, "rb") as f:
                files.append((var, f.read()))
        except OSError as exc:
            raise ConfigurationError(
                f"{var}={path!r} on the driver cannot be read ({exc.strerror}); it must name "
                "the certificate file MLflow's client uses"
            ) from exc
    return Credentials(tuple(env), tuple(files)) if env or files else None


def _key(secret: bytes) -> bytes:
    return hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()


def seal(secret: bytes, credentials: Credentials) -> Sealed:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    plain = json.dumps({
        "env": list(credentials.env),
        "files": [(k, base64.b64encode(v).decode()) for k, v in credentials.files],
    }).encode()
    nonce = os.urandom(12)
    return Sealed(nonce, AESGCM(_key(secret)).encrypt(nonce, plain, _AAD))


def unseal(secret: bytes, sealed: Sealed) -> Credentials:
    """Raises ``cryptography.exceptions.InvalidTag`` if not sealed with ``secret``."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    data = json.loads(AESGCM(_key(secret)).decrypt(sealed.nonce, sealed.data, _AAD))
    return Credentials(
        tuple((str(k), str(v)) for k, v in data["env"]),
        tuple((str(k), base64.b64decode(v)) for k, v in data["files"]),
    )
