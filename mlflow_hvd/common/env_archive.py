"""Packs the driver's Python environment for executors that do not have it, the way Spark's
"Python Package Management" guide does: venv-pack makes an archive, ``spark.archives=
<archive>#environment`` unpacks it in every executor's working directory and executors
start ``./environment/bin/python``.

The archive is made once and cached (``$MLFLOW_HVD_CACHE/envs``, default
``~/.cache/mlflow_hvd/envs``) under a digest of what is in it: the interpreter, the platform,
Horovod's build, every installed distribution and the sources of editable installs. A later
run with the same environment reuses it; the two newest archives are kept.

What changes on the way:

* editable installs (``pip install -e``, as ``make setup`` and ``mlflow run`` install this
  project) point at a checkout the executors do not have: their sources are packed into
  ``site-packages`` instead, and the editable hooks are left out;
* ``pyspark/jars`` is left out (462 MB): executors run their own Spark, whose
  ``pyspark.zip`` comes first on their Python workers' path;
* :data:`FINGERPRINT_FILE` records what the archive needs where it is unpacked.

venv-pack does not copy the interpreter: ``bin/python`` stays a link to the base Python
(:attr:`EnvironmentFingerprint.base_python`), which every executor needs at the same path.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import os
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow_hvd.common.cache import cache_root, keep_newest
from mlflow_hvd.common.environment import current
from mlflow_hvd.errors import EnvironmentArchiveError
from mlflow_hvd.protocol.environment import (
    ARCHIVE_ALIAS,
    FINGERPRINT_FILE,
    SHIPPED_PYTHON,
    EnvironmentFingerprint,
)

FORMAT_VERSION = 1  # of what this module puts in an archive (part of the digest)
KEEP = 2  # archives kept in the cache
LEFT_OUT = ("pyspark/jars/",)  # under site-packages


@dataclass(frozen=True)
class PackedEnvironment:
    """An environment archive ready for ``spark.archives``.

    Attributes:
        path: The archive (``.tar.gz``).
        digest: What it holds, hashed (its file name has the first 16 characters).
        size: Its bytes.
        seconds: How long packing took (0.0 when a cached archive was reused).
        reused: Whether it came from the cache.
        fingerprint: What it needs where it is unpacked.
    """

    path: str
    digest: str
    size: int
    seconds: float
    reused: bool
    fingerprint: EnvironmentFingerprint

    def spark_conf(self) -> dict[str, str]:
        """The session settings that ship it (executors then need ``PYSPARK_PYTHON`` =
        :data:`SHIPPED_PYTHON` in the driver's environment when the context starts)."""
        return {"spark.archives": f"{self.path}#{ARCHIVE_ALIAS}"}


def cache_dir() -> Path:
    return cache_root() / "envs"


def editable_sources(site: str) -> dict[str, str]:
    """Top-level package -> source directory of every editable install in ``site`` made
    through setuptools' import hook (``__editable___*_finder.py``: its ``MAPPING``)."""
    found: dict[str, str] = {}
    for finder in sorted(Path(site).glob("__editable___*_finder.py")):
        tree = ast.parse(finder.read_text())
        for node in tree.body:
            target: ast.expr
            if isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            elif isinstance(node, ast.Assign):
                target, value = node.targets[0], node.value
            else:
                continue
            if isinstance(target, ast.Name) and target.id == "MAPPING":
                found.update(ast.literal_eval(value))
    return found


def _source_files(root: str) -> Iterator[Path]:
    for path in sorted(Path(root).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            yield path


def digest_of(fingerprint: EnvironmentFingerprint, sources: dict[str, str]) -> str:
    """What an archive of this environment holds, hashed: the fingerprint and the content
    of every editable source file."""
    h = hashlib.sha256(f"{FORMAT_VERSION}\n{fingerprint.dumps()}\n".encode())
    for name, root in sorted(sources.items()):
        for path in _source_files(root):
            h.update(f"{name}/{path.relative_to(root)}\n".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


COMPRESS_ENV = "MLFLOW_HVD_PACK_COMPRESS_LEVEL"
DEFAULT_COMPRESS_LEVEL = 1


def compress_level_setting() -> int:
    """The gzip level archives are packed with when no caller names one:
    ``MLFLOW_HVD_PACK_COMPRESS_LEVEL`` (0-9; 0 stores without compressing), default 1.

    Raises:
        EnvironmentArchiveError: The variable is not a whole number from 0 to 9.
    """
    text = os.environ.get(COMPRESS_ENV, "").strip()
    if not text:
        return DEFAULT_COMPRESS_LEVEL
    if not (text.isdigit() and 0 <= int(text) <= 9):
        raise EnvironmentArchiveError(
            f"{COMPRESS_ENV}={text!r}: must be a gzip level from 0 to 9 (0: stored, no "
            f"compression); unset it for the default {DEFAULT_COMPRESS_LEVEL}")
    return int(text)


def pack_environment(cache: Path | None = None, compress_level: int | None = None
                     ) -> PackedEnvironment:
    """This interpreter's venv as an archive for ``spark.archives``: the cached one when
    nothing changed, else packed now, with gzip level ``compress_level`` (None:
    :func:`compress_level_setting`; 0: stored, not compressed).

    Raises:
        EnvironmentArchiveError: Not a venv, or venv-pack refuses it (e.g. an editable
            install through a path in a ``.pth`` file), or a bad compression setting.
    """
    if compress_level is None:
        compress_level = compress_level_setting()
    if sys.prefix == sys.base_prefix:
        raise EnvironmentArchiveError(
            f"{sys.prefix} is not a virtual environment: venv-pack packs venvs (python -m "
            "venv); make one for the job, or give every node the same environment")
    site = sysconfig.get_paths()["purelib"]
    fingerprint = current()
    sources = editable_sources(site)
    digest = digest_of(fingerprint, sources)
    where = cache or cache_dir()
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"env-{digest[:16]}{suffix(compress_level)}"
    if path.exists():
        os.utime(path)  # the newest archives are the ones kept
        return PackedEnvironment(str(path), digest, path.stat().st_size, 0.0, True,
                                 fingerprint)
    start = time.monotonic()
    _pack(path, site, fingerprint, sources, compress_level)
    keep_newest(where, "env-*.tar*", KEEP)
    return PackedEnvironment(str(path), digest, path.stat().st_size,
                             time.monotonic() - start, False, fingerprint)


def _pack(path: Path, site: str, fingerprint: EnvironmentFingerprint,
          sources: dict[str, str], compress_level: int) -> None:
    import venv_pack

    try:
        env = venv_pack.Env(sys.prefix)
    except venv_pack.VenvPackException as exc:
        raise EnvironmentArchiveError(
            f"venv-pack cannot pack {sys.prefix}: {exc}. Reinstall such packages without "
            "-e (pip install <dir>), or as setuptools' editable hook") from exc
    site_rel = os.path.relpath(site, sys.prefix)
    files = [f for f in env.files
             if not any(f.target.startswith(os.path.join(site_rel, p)) for p in LEFT_OUT)
             and not _editable_hook(f.target)]
    for name, root in sorted(sources.items()):
        files += [venv_pack.File(str(p), os.path.join(site_rel, name, str(p.relative_to(root))))
                  for p in _source_files(root)]
    # what unpacking takes on each executor's disk (its files; links count as nothing)
    unpacked = sum(os.lstat(f.source).st_size for f in files if not os.path.islink(f.source))
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        record = Path(tmp) / FINGERPRINT_FILE
        record.write_text(dataclasses.replace(fingerprint, unpacked_bytes=unpacked).dumps())
        # first in the archive: the driver reads it without decompressing the rest
        env.files = [venv_pack.File(str(record), FINGERPRINT_FILE), *files]
        partial = Path(tmp) / path.name
        # always gzip's container: Spark unpacks a .tar.gz with the system's tar, but a
        # plain .tar with its own Java code, which refuses the venv's bin/python (a symlink
        # to the base interpreter: "would create entry outside of ..."); level 0 stores
        env.pack(output=str(partial), format="tar.gz", compress_level=compress_level,
                 force=True)
        partial.chmod(0o644)  # venv-pack writes through mkstemp (0600)
        os.replace(partial, path)


def suffix(compress_level: int) -> str:
    """An archive's ending: ``.tar.gz`` for gzip levels 1-9, ``.stored.tar.gz`` for level 0
    (gzip's container around uncompressed blocks: nothing to compress or inflate, and Spark
    still unpacks it with the system's tar)."""
    return ".tar.gz" if compress_level else ".stored.tar.gz"


def _editable_hook(target: str) -> bool:
    """Whether a file is one of setuptools' editable hooks (a finder, its .pth, their
    bytecode)."""
    return os.path.basename(target).startswith("__editable__")



def describe(packed: PackedEnvironment) -> dict[str, Any]:
    """What the pack command prints (JSON)."""
    return {"archive": packed.path, "bytes": packed.size, "seconds": round(packed.seconds, 1),
            "reused": packed.reused, "spark_conf": packed.spark_conf(),
            "PYSPARK_PYTHON": SHIPPED_PYTHON, "base_python": packed.fingerprint.base_python}


def fingerprint_of_archive(path: str) -> EnvironmentFingerprint | None:
    """The fingerprint an archive made here records (its first member), or None for any
    other archive."""
    try:
        with tarfile.open(path, "r:*") as tar:
            first = tar.next()
            if first is None or first.name != FINGERPRINT_FILE:
                return None
            data = tar.extractfile(first)
            return EnvironmentFingerprint.loads(data.read().decode()) if data else None
    except (OSError, tarfile.TarError, ValueError, KeyError):
        return None


def shipped_archive(archives: str) -> str | None:
    """The local file of the ``#environment`` entry of a ``spark.archives`` setting."""
    for entry in (e.strip() for e in archives.split(",")):
        file, _, alias = entry.partition("#")
        if alias == ARCHIVE_ALIAS:
            return file[len("file:"):] if file.startswith("file:") else file
    return None
