"""The rank's import guard for Horovod's Keras layers (rank/keras_guard.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


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


def _fake_packages(root: Path, flags_module: bool, triton: bool) -> None:
    """A ``tensorflow`` that records what was loaded before it, with or without the module
    TensorFlow >= 2.20's wheels ship to load their library globally; maybe a ``triton``."""
    (root / "tensorflow" / "python").mkdir(parents=True)
    (root / "tensorflow" / "__init__.py").write_text(
        "import sys\nLOADED_BEFORE = sorted(m for m in ('triton',) if m in sys.modules)\n")
    if flags_module:
        (root / "tensorflow" / "python" / "pywrap_dlopen_global_flags.py").write_text("")
    if triton:
        (root / "triton").mkdir()
        (root / "triton" / "__init__.py").write_text(
            "import sys\nassert 'tensorflow' not in sys.modules\n")


def test_a_rank_loads_triton_before_a_tensorflow_that_would_crash_it(tmp_path: Path) -> None:
    """TensorFlow >= 2.20 loads its LLVM globally and a Triton loaded after it dies of
    SIGSEGV (rank/llvm_order.py): the guard loads Triton first, and only where both hold.
    The real pair is run in the new end's tier (test_torch: collectives after a Keras job)."""
    script = textwrap.dedent("""
        import json, sys
        from mlflow_hvd.rank import keras_guard
        keras_guard.install()
        import tensorflow
        print(json.dumps(tensorflow.LOADED_BEFORE))
    """)
    seen = {}
    for flags_module, triton in ((True, True), (False, True), (True, False)):
        root = tmp_path / f"{flags_module}-{triton}"
        _fake_packages(root, flags_module, triton)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
        assert out.returncode == 0, out.stderr
        seen[(flags_module, triton)] = json.loads(out.stdout)
    assert seen == {(True, True): ["triton"], (False, True): [], (True, False): []}
