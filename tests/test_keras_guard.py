"""The rank's import guard for Horovod's Keras layers (rank/keras_guard.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


def test_the_keras_guard_reads_package_metadata_only_when_a_refused_layer_is_imported() -> None:
    """Installing it is on every rank's way to ``main``: reading metadata there cost
    0.2-0.3 s in Spark tasks. The refusal itself is tested end to end in test_keras_dropin."""
    script = textwrap.dedent("""
        import importlib.metadata, sys
        calls = []
        real = importlib.metadata.version
        importlib.metadata.version = lambda name: calls.append(name) or real(name)
        from mlflow_hvd.errors import IncompatibleImportError
        from mlflow_hvd.rank import keras_guard
        assert keras_guard.install() and not keras_guard.install()
        import json  # any other import passes the guard untouched
        assert calls == [], calls
        try:
            import horovod.keras
        except IncompatibleImportError as exc:
            print(json.dumps([calls, str(exc)]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    calls, message = json.loads(out.stdout)
    assert calls == ["keras"]  # once, at the refused import
    assert message.startswith("horovod.keras does not work with Keras 3.")
    assert message.endswith("Replace `import horovod.tensorflow.keras as hvd` with "
                            "`import mlflow_hvd.keras as hvd`: the same names, on Keras 3 "
                            "(docs/keras.md, Migrating)")
