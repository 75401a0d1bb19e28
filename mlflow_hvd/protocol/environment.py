"""What an environment shipped to executors must match where it is unpacked: the facts the
driver records in the archive when it packs it and a Spark task compares with what it finds
before its rank starts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

ARCHIVE_ALIAS = "environment"  # spark.archives=<file>#environment: unpacked as ./environment
FINGERPRINT_FILE = "mlflow-hvd-environment.json"  # at the archive's root
SHIPPED_PYTHON = f"./{ARCHIVE_ALIAS}/bin/python"  # the executors' PYSPARK_PYTHON


@dataclass(frozen=True)
class EnvironmentFingerprint:
    """An environment's interpreter and Horovod build, as packed.

    Attributes:
        python: The interpreter's version (``3.11.7``).
        platform: ``sysconfig.get_platform()`` and the C library (``linux-x86_64 glibc
            2.36``): compiled extensions load only on the same.
        base_python: The interpreter a venv links to (venv-pack does not copy it): every
            executor needs it at this path.
        horovod: Horovod's version, or "" when it is not installed.
        extensions: Horovod's framework extensions present (``tensorflow``, ``torch``).
        packages: ``name==version`` of every distribution, sorted.
        unpacked_bytes: The disk space the archive takes unpacked, counted as it is packed
            (venv-pack's path rewriting in scripts aside; 0: not known, e.g. an environment
            described before it is packed).
    """

    python: str
    platform: str
    base_python: str
    horovod: str
    extensions: tuple[str, ...]
    packages: tuple[str, ...]
    unpacked_bytes: int = 0

    def dumps(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def loads(cls, text: str) -> EnvironmentFingerprint:
        raw = json.loads(text)
        return cls(raw["python"], raw["platform"], raw["base_python"], raw["horovod"],
                   tuple(raw["extensions"]), tuple(raw["packages"]),
                   int(raw.get("unpacked_bytes", 0)))

    def differences(self, found: EnvironmentFingerprint) -> list[str]:
        """What ``found`` (an executor's) lacks of this one, each as 'what: expected X,
        found Y' (packages are not compared: they travel in the archive)."""
        out = []
        for name in ("python", "platform", "horovod"):
            want, got = getattr(self, name), getattr(found, name)
            if want != got:
                out.append(f"{name}: expected {want or 'none'}, found {got or 'none'}")
        missing = sorted(set(self.extensions) - set(found.extensions))
        if missing:
            out.append(f"Horovod's extensions: expected {', '.join(self.extensions)}, found "
                       f"{', '.join(found.extensions) or 'none'}")
        return out
