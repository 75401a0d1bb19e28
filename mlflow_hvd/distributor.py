"""``TorchDistributor``: pyspark's ``pyspark.ml.torch.distributor.TorchDistributor`` API on
HorovodRunner, so that code written for it moves by changing one import.

pyspark's starts a ``torchrun`` in each barrier task; here each task hosts one rank, which
gets ``torchrun``'s variables and the job's store (docs/pytorch.md), and everything the
runner gives a job comes with it: rank 0's MLflow run, DataFrame arguments sharded,
restarts, elastic jobs, shipped environments, warm ranks.
"""

from __future__ import annotations

import glob
import inspect
import os
from collections.abc import Callable
from typing import Any

from mlflow_hvd.common import config
from mlflow_hvd.errors import ConfigurationError

GPU_AMOUNT = "spark.task.resource.gpu.amount"


class TorchDistributor:
    """Runs a PyTorch function or script on ``num_processes`` processes, as pyspark's
    ``TorchDistributor(num_processes=1, local_mode=True, use_gpu=True)`` does.

    Args:
        num_processes: How many processes (ranks) train, one GPU each with ``use_gpu``.
        local_mode: Run them on the driver (``HorovodRunner(np=-num_processes)``), else as
            the tasks of one Spark barrier stage (``np=num_processes``) of the active
            session, or of one the runner starts.
        use_gpu: Each process uses a GPU: on the driver, this machine's; on Spark, the one
            Spark's resource scheduling assigns its task (``spark.task.resource.gpu.amount``
            = 1). False: Spark tasks' processes see none (``CUDA_VISIBLE_DEVICES=""``); the
            driver's see what the driver sees, as under pyspark's.
        **runner_options: HorovodRunner's own options (``job=``, ``cluster=``,
            ``tracking=``, ``horovod=``, ``driver_log_verbosity=``).

    Raises:
        ConfigurationError: ``num_processes`` is not a positive integer; ``use_gpu`` where
            there are no GPUs to use (naming what to set); a runner option HorovodRunner
            does not take.
    """

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True,
                 **runner_options: Any) -> None:
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) \
                or num_processes < 1:
            raise ConfigurationError(
                f"TorchDistributor(num_processes={num_processes!r}): the number of processes "
                "must be a positive integer (one per GPU with use_gpu=True)")
        for name in runner_options:
            if name == "np" or name not in config.RUNNER_ARGUMENTS:
                raise ConfigurationError(config.misplaced(name, "TorchDistributor") + (
                    " (np is num_processes here)" if name == "np" else ""))
        self.num_processes, self.local_mode, self.use_gpu = num_processes, local_mode, use_gpu
        if use_gpu:
            _check_gpus(local_mode)
        from mlflow_hvd.runner import HorovodRunner

        np = -num_processes if local_mode else num_processes
        self._runner = HorovodRunner(np=np, **runner_options)

    @property
    def runner(self) -> Any:
        """The :class:`~mlflow_hvd.HorovodRunner` that runs the jobs (its ``last_run_id``
        names the last job's MLflow run)."""
        return self._runner

    def run(self, train_object: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object(*args, **kwargs)`` on every process and return rank 0's value;
        or, for a path, run that script on every process with ``args`` as its command line
        (strings, as ``torchrun script.py args`` passes them) and return None. A
        DataFrame among ``kwargs`` is sharded over the processes (docs/data.md).

        Raises:
            ConfigurationError: ``train_object`` does not take these arguments; a script
                that does not exist or is given keyword arguments (before any process
                starts).
            WorkerFailedError: A process failed (its rank, host and traceback).
        """
        from mlflow_hvd.rank.torch_dist import Call

        if isinstance(train_object, str | os.PathLike):
            path = os.fspath(train_object)
            if kwargs:
                raise ConfigurationError(
                    f"TorchDistributor.run({path!r}, ...) was given keyword arguments "
                    f"({', '.join(sorted(kwargs))}): a script takes its command line only; "
                    "pass them as strings, e.g. run(path, '--lr', '0.01')")
            if not os.path.isfile(path):
                raise ConfigurationError(
                    f"TorchDistributor.run({path!r}): no such file on the driver. The script "
                    "is read here and sent to every process (no executor needs a copy): give "
                    "its path on this machine")
            with open(path, encoding="utf-8") as f:
                source = f.read()
            return self._runner.run_with(self._hooks(), Call(path, tuple(map(str, args)),
                                                             source))
        if not callable(train_object):
            raise ConfigurationError(
                f"TorchDistributor.run(train_object): a function or the path of a script, "
                f"got {type(train_object).__name__}")
        _check_arguments(train_object, args, kwargs)
        return self._runner.run_with(self._hooks(), Call(train_object, args), **kwargs)

    def _hooks(self) -> Any:
        """What every process has while a job runs, set before the job's code is unpickled
        and restored after it, as pyspark's TorchDistributor gives it: with
        ``local_mode=False`` each task a torchrun node of its own (``LOCAL_RANK`` 0 in every
        task: Lightning's ``Trainer(devices=1, num_nodes=num_processes)``) and, with
        ``use_gpu=False``, no GPU (``CUDA_VISIBLE_DEVICES=""``); with ``local_mode=True`` one
        torchrun of ``num_processes`` on the driver, which sets ``OMP_NUM_THREADS=1`` for
        more than one process unless the driver sets it (it acts when torch is first
        imported: a warm rank keeps its first job's)."""
        from mlflow_hvd.runner import RunHooks

        env: list[tuple[str, str]] = []
        if not self.local_mode and not self.use_gpu:
            env.append(("CUDA_VISIBLE_DEVICES", ""))
        if self.local_mode and self.num_processes > 1 and "OMP_NUM_THREADS" not in os.environ:
            env.append(("OMP_NUM_THREADS", "1"))
        return RunHooks(rank_env=tuple(env), torch_nodes_are_tasks=not self.local_mode)


def _check_arguments(fn: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable Python cannot describe: the ranks will tell
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigurationError(
            f"TorchDistributor.run({name}, ...): {exc} (its signature: {name}{signature})"
        ) from None


def _check_gpus(local_mode: bool) -> None:
    """``use_gpu=True`` needs GPUs: on the driver, device files of NVIDIA's driver; on
    Spark, an active session whose tasks each get one GPU."""
    if local_mode:
        if not glob.glob("/dev/nvidia[0-9]*"):
            raise ConfigurationError(
                "TorchDistributor(use_gpu=True, local_mode=True) but this machine has no GPU "
                "(no /dev/nvidia* device): pass use_gpu=False to train on its CPUs "
                "(pyspark's TorchDistributor refuses this too: its use_gpu defaults to True)")
        return
    from mlflow_hvd.backends.spark.api import active_session, session_api

    session = active_session()
    amount = (session_api(session).conf().get(GPU_AMOUNT) if session is not None else None)
    if not amount or float(amount) < 1:
        where = ("the active SparkSession has " + (f"{GPU_AMOUNT}={amount}" if amount else
                                                   f"no {GPU_AMOUNT}")
                 if session is not None else "there is no active SparkSession to say so")
        raise ConfigurationError(
            f"TorchDistributor(use_gpu=True, local_mode=False) needs a GPU for each task, and "
            f"{where}: start the session with {GPU_AMOUNT}=1 (and "
            "spark.executor.resource.gpu.amount, docs/gpus.md), or pass use_gpu=False")
    if float(amount) > 1:
        raise ConfigurationError(
            f"{GPU_AMOUNT}={amount}: pyspark's TorchDistributor starts that many processes "
            "per task; HorovodRunner runs one process per task. Set it to 1 and "
            "num_processes to the number of GPUs")
