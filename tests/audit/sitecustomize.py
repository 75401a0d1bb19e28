"""Counts the processes of a test session that import TensorFlow (the suite's main cost),
those that import PyTorch, and those that import PyTorch Lightning (MLflow's
``mlflow.pytorch`` imports it whenever it is installed: seconds of every process that logs
or loads a PyTorch model).

``tests/conftest.py`` puts this directory on ``PYTHONPATH`` and names a file in
``MLFLOW_HVD_TEST_TF_LOG``; every Python process started under the session (the pytest
process, local ranks, Spark's Python workers and their ranks, drivers started by tests)
then appends one line to it when it first imports ``tensorflow``, naming the test that was
running where the process was started (pytest's ``PYTEST_CURRENT_TEST``; empty for ranks
of Spark executors, which do not inherit the test's environment).
"""

import os
import sys

_LOG = os.environ.get("MLFLOW_HVD_TEST_TF_LOG")


class _FirstTensorFlowImport:
    """Also counts ``torch`` and ``pytorch_lightning`` (lines that start with ``torch `` and
    ``lightning ``)."""

    def __init__(self) -> None:
        self.pending = {"tensorflow": "", "torch": "torch ", "pytorch_lightning": "lightning "}

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name not in self.pending or not _importing():
            return None  # a probe (importlib.util.find_spec), not an import
        prefix = self.pending.pop(name, None)
        if prefix is not None and _LOG:
            if not self.pending:
                sys.meta_path.remove(self)
            with open(_LOG, "a") as log:
                test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
                log.write(f"{prefix}{os.getpid()} {' '.join(sys.argv)[:120]} [{test}]\n")
        return None  # the normal import goes on


def _importing() -> bool:
    """Whether an import statement (not ``importlib.util.find_spec``) asks: the import
    system's own frames call the finders."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_name == "_find_and_load_unlocked":
            return True
        frame = frame.f_back
    return False


if _LOG:
    sys.meta_path.insert(0, _FirstTensorFlowImport())
