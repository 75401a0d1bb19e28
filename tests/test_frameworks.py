"""Horovod and TensorFlow are optional: what needs one says so where it is missing, naming
the command that installs it (the rank's error hint, the Keras layer, ``tf_dataset``), and a
rank whose driver runs no rendezvous server is refused at ``import horovod.torch``.

The whole path in an environment that has neither (a fresh ``pip install .[torch]``) is
tests/test_torch_only.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlflow_hvd.common import compat
from mlflow_hvd.errors import IncompatibleImportError
from mlflow_hvd.rank import frameworks


def _missing(name: str) -> ModuleNotFoundError:
    try:
        __import__(name)
    except ModuleNotFoundError as exc:
        return exc
    raise AssertionError(f"{name} imported")


def test_a_rank_that_imports_a_missing_horovod_is_told_the_command_that_builds_it() -> None:
    exc = _missing("horovod_not_here_either")  # a real ModuleNotFoundError, renamed
    exc.name = "horovod.torch"
    assert frameworks.hint(exc) == (
        f" - Horovod is not installed in this rank's environment ({sys.prefix}): the training "
        "function imports it. Build it there with `python -m mlflow_hvd.cli.horovod` (against "
        "the PyTorch and TensorFlow installed; docs/install.md), or write the function with "
        "torch.distributed, which needs no Horovod")
    # raised through the user's own handler: the cause is found
    try:
        try:
            raise exc
        except ImportError as inner:
            raise RuntimeError("could not set up the model") from inner
    except RuntimeError as outer:
        assert frameworks.hint(outer).startswith(" - Horovod is not installed")


def test_a_missing_tensorflow_and_an_unbuilt_extension_are_named_other_errors_are_not() -> None:
    exc = _missing("tensorflow_not_here")
    exc.name = "tensorflow.keras"
    assert frameworks.hint(exc) == (
        f" - TensorFlow is not installed in this rank's environment ({sys.prefix}): the "
        "training function imports it. pip install 'mlflow_hvd[tensorflow-cpu]' (or "
        "'mlflow_hvd[tensorflow]' for GPUs)")
    unbuilt = ImportError("Extension horovod.torch has not been built: /x/mpi_lib_v2.so not "
                          "found")
    assert frameworks.hint(unbuilt).endswith("`python -m mlflow_hvd.cli.horovod --rebuild`")
    assert frameworks.hint(_missing("no_such_module_at_all")) == ""
    assert frameworks.hint(ValueError("horovod")) == ""


def test_a_rank_without_a_rendezvous_server_refuses_horovods_frameworks_at_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOROVOD_RANK", "1")
    monkeypatch.delenv("HOROVOD_GLOO_RENDEZVOUS_PORT", raising=False)
    with pytest.raises(IncompatibleImportError, match=(
        r"^horovod\.torch is imported in a rank, but the driver has no Horovod, so no Gloo "
        r"rendezvous server runs for hvd\.init\(\): .* Run `python -m mlflow_hvd\.cli\.horovod` "
        r"in the driver's environment")):
        frameworks.check_rendezvous("horovod.torch")
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_PORT", "41234")
    frameworks.check_rendezvous("horovod.torch")
    monkeypatch.delenv("HOROVOD_RANK")
    monkeypatch.delenv("HOROVOD_GLOO_RENDEZVOUS_PORT")
    frameworks.check_rendezvous("horovod.tensorflow")  # not a rank: nothing to refuse


def test_the_import_guard_applies_the_rendezvous_check_to_a_real_horovod_torch() -> None:
    """In a rank process (the guard installed, HOROVOD_RANK set) without a rendezvous port,
    the real ``import horovod.torch`` is refused after it loads; with one, it imports."""
    code = ("from mlflow_hvd.rank import keras_guard\nkeras_guard.install()\n"
            "try:\n    import horovod.torch\n    print('IMPORTED')\n"
            "except ImportError as exc:\n    print(type(exc).__name__, exc)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    refused = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env={**env, "HOROVOD_RANK": "0"})
    assert refused.stdout.startswith("IncompatibleImportError horovod.torch is imported in a "
                                     "rank, but the driver has no Horovod"), refused.stderr
    allowed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env={**env, "HOROVOD_RANK": "0",
                                               "HOROVOD_GLOO_RENDEZVOUS_PORT": "1"})
    assert allowed.stdout.strip() == "IMPORTED", allowed.stderr


def test_what_needs_tensorflow_or_horovod_names_the_command_where_either_is_missing(
    tmp_path: Path,
) -> None:
    """A distribution named like TensorFlow's/Horovod's hidden: an empty metadata path
    stands for an environment without them."""
    code = ("from mlflow_hvd.common import compat\nimport importlib.metadata as md\n"
            "real = md.version\n"
            "def version(name):\n"
            "    if name.startswith(('tensorflow', 'horovod')):\n"
            "        raise md.PackageNotFoundError(name)\n"
            "    return real(name)\n"
            "compat.version = version\n"
            "for what in ('tensorflow', 'horovod'):\n"
            "    try:\n"
            "        getattr(compat, 'require_' + what)('mlflow_hvd.keras (the Keras layer)')\n"
            "    except ImportError as exc:\n"
            "        print(type(exc).__name__, exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    lines = proc.stdout.splitlines()
    assert lines == [
        "IncompatibleImportError mlflow_hvd.keras (the Keras layer) needs TensorFlow, which is "
        f"not installed in this environment ({sys.prefix}): pip install "
        "'mlflow_hvd[tensorflow-cpu]' (or 'mlflow_hvd[tensorflow]' for GPUs), then `python -m "
        "mlflow_hvd.cli.horovod` for Horovod",
        "IncompatibleImportError mlflow_hvd.keras (the Keras layer) needs Horovod, which is not "
        f"installed in this environment ({sys.prefix}): run `python -m mlflow_hvd.cli.horovod` "
        "(it builds Horovod 0.28.1 against the PyTorch and TensorFlow installed; "
        "docs/install.md)",
    ], proc.stderr[-2000:]
    # installed here: nothing refused
    compat.require_tensorflow("x")
    compat.require_horovod("x")


def test_a_ranks_identity_is_read_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout the agent started the rank with (HOROVOD_* and the host the driver names
    it by); outside a worker, rank 0 of 1 on this host."""
    import socket

    from mlflow_hvd.rank import identity

    for name in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_HOSTNAME",
                 "MLFLOW_HVD_HOST"):
        monkeypatch.delenv(name, raising=False)
    assert identity.current() == identity.RankIdentity(0, 1, 0, socket.gethostname(), False)
    monkeypatch.setenv("HOROVOD_RANK", "3")
    monkeypatch.setenv("HOROVOD_SIZE", "4")
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "1")
    monkeypatch.setenv("HOROVOD_HOSTNAME", "10.0.0.2")
    assert identity.current() == identity.RankIdentity(3, 4, 1, "10.0.0.2", True)
    monkeypatch.setenv("MLFLOW_HVD_HOST", "node-b")
    assert identity.current().host == "node-b"
