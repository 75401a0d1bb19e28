"""Horovod's tuning knobs for a job's ranks: ``horovodrun``'s flags as :class:`HorovodOptions`,
and the ``HOROVOD_*`` variables of the user's environment, minus the ones the runner owns.

Horovod reads its knobs from the environment of each rank. The runner sets, per rank, the
variables that make a rank part of *this* job (:data:`OWNED`: its rank and size, the
rendezvous server, the controller); a user's value for one of those would silently break the
job, so it is refused, naming it. Every other ``HOROVOD_*`` variable is tuning and reaches
every rank: from :class:`HorovodOptions` (turned into variables by Horovod's own
``config_parser``, exactly as ``horovodrun`` does), else from the driver's environment, else
from the executor's (``spark.executorEnv.*``).

The timeline and the autotune log are files Horovod writes on rank 0's host. Their
variables are set by the agent to files in the rank's private scratch directory; rank 0 logs
them to the job's run (``horovod/timeline.json``, ``horovod/autotune_log.csv``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

from mlflow_hvd.errors import ConfigurationError

# Set by the runner for each rank (horovod.runner.gloo_run.create_slot_env_vars /
# create_run_env_vars): a user's value would make the rank part of another job
OWNED = frozenset({
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_CONTROLLER",
    "HOROVOD_CPU_OPERATIONS", "HOROVOD_GLOO_IFACE",
})
# Files Horovod writes (on rank 0): variable -> the artifact rank 0 logs it as
FILES = {
    "HOROVOD_TIMELINE": "horovod/timeline.json",
    "HOROVOD_AUTOTUNE_LOG": "horovod/autotune_log.csv",
}
PREFIX = "HOROVOD_"


@dataclass(frozen=True)
class HorovodOptions:
    """``horovodrun``'s tuning flags, for every rank of a job (None: Horovod's default, or
    the ``HOROVOD_*`` variable of the environment if set).

    Attributes:
        timeline: Record a Horovod Timeline on rank 0 and log it to the run as
            ``horovod/timeline.json`` (opens in chrome://tracing or https://ui.perfetto.dev)
            (``--timeline-filename``).
        timeline_mark_cycles: Mark Horovod's cycles in the timeline (``--timeline-mark-cycles``).
        fusion_threshold_mb: Tensor fusion buffer size in MB (``--fusion-threshold-mb``).
        cycle_time_ms: Milliseconds between negotiation cycles (``--cycle-time-ms``).
        cache_capacity: Response cache capacity (``--cache-capacity``).
        hierarchical_allreduce: ``--hierarchical-allreduce`` (True) or
            ``--no-hierarchical-allreduce`` (False).
        hierarchical_allgather: ``--hierarchical-allgather`` / ``--no-hierarchical-allgather``.
        autotune: Let Horovod tune fusion threshold and cycle time (``--autotune``).
        autotune_log: With ``autotune``, log the samples to the run as
            ``horovod/autotune_log.csv`` (``--autotune-log-file``).
    """

    timeline: bool = False
    timeline_mark_cycles: bool = False
    fusion_threshold_mb: int | None = None
    cycle_time_ms: float | None = None
    cache_capacity: int | None = None
    hierarchical_allreduce: bool | None = None
    hierarchical_allgather: bool | None = None
    autotune: bool = False
    autotune_log: bool = False

    def __post_init__(self) -> None:
        for name in ("fusion_threshold_mb", "cache_capacity"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ConfigurationError(
                    f"HorovodOptions({name}={value!r}): must be a non-negative integer")
        if self.cycle_time_ms is not None and (
            isinstance(self.cycle_time_ms, bool)
            or not isinstance(self.cycle_time_ms, int | float) or self.cycle_time_ms <= 0
        ):
            raise ConfigurationError(
                f"HorovodOptions(cycle_time_ms={self.cycle_time_ms!r}): must be a positive "
                "number of milliseconds")
        if self.autotune_log and not self.autotune:
            raise ConfigurationError(
                "HorovodOptions(autotune_log=True) needs autotune=True: the log records the "
                "autotuner's samples")
        if self.timeline_mark_cycles and not self.timeline:
            raise ConfigurationError(
                "HorovodOptions(timeline_mark_cycles=True) needs timeline=True")

    def env(self) -> dict[str, str]:
        """The variables ``horovodrun`` would set for these flags (Horovod's own
        ``config_parser.set_env_from_args``); file variables hold a placeholder the agent
        replaces with a path on the rank's host."""
        from mlflow_hvd.common.horovod_launcher import config_parser

        args = argparse.Namespace(**{name: None for name in _HOROVODRUN_ARGS})
        args.fusion_threshold_mb = self.fusion_threshold_mb
        args.cycle_time_ms = self.cycle_time_ms
        args.cache_capacity = self.cache_capacity
        args.hierarchical_allreduce = self.hierarchical_allreduce
        args.hierarchical_allgather = self.hierarchical_allgather
        args.autotune = self.autotune or None
        args.autotune_log_file = _PLACEHOLDER if self.autotune_log else None
        args.timeline_filename = _PLACEHOLDER if self.timeline else None
        args.timeline_mark_cycles = self.timeline_mark_cycles or None
        env: dict[str, str] = {}
        config_parser.set_env_from_args(env, args)
        return {k: str(v) for k, v in env.items()}


_PLACEHOLDER = "<on rank 0's host>"
# every attribute config_parser.set_env_from_args reads
_HOROVODRUN_ARGS = (
    "fusion_threshold_mb", "cycle_time_ms", "cache_capacity", "hierarchical_allreduce",
    "hierarchical_allgather", "torus_allreduce", "autotune", "autotune_log_file",
    "autotune_warmup_samples", "autotune_steps_per_sample", "autotune_bayes_opt_max_samples",
    "autotune_gaussian_process_noise", "timeline_filename", "timeline_mark_cycles",
    "no_stall_check", "stall_check_warning_time_seconds", "stall_check_shutdown_time_seconds",
    "mpi_threads_disable", "num_nccl_streams", "tcp_flag", "thread_affinity",
    "gloo_timeout_seconds", "log_level", "log_with_timestamp",
)


def refuse_owned(names: Iterable[str], where: str) -> None:
    """Raise :class:`ConfigurationError` if any of ``names`` is a variable the runner owns."""
    owned = sorted(n for n in names if n in OWNED)
    if owned:
        raise ConfigurationError(
            f"{', '.join(owned)} set in {where}: the runner sets "
            f"{'it' if len(owned) == 1 else 'them'} for each rank (rank, size, rendezvous, "
            "controller), and a value of yours would join the rank to another job. Unset "
            f"{'it' if len(owned) == 1 else 'them'}"
        )


def tuning(environ: Mapping[str, str], where: str) -> dict[str, str]:
    """The ``HOROVOD_*`` tuning variables of ``environ``.

    Raises:
        ConfigurationError: ``environ`` sets a variable of :data:`OWNED`, named.
    """
    names = [k for k in environ if k.startswith(PREFIX)]
    refuse_owned(names, where)
    return {k: environ[k] for k in names}


def job_env(options: HorovodOptions | None, environ: Mapping[str, str]) -> dict[str, str]:
    """What every rank of a job gets: the driver's tuning variables, overridden by
    ``options``."""
    env = tuning(environ, "the driver's environment")
    if options is not None:
        env.update(options.env())
    return env


def rank_files(env: Mapping[str, str], directory: str, rank: int) -> dict[str, str]:
    """Point the file variables present in ``env`` at files in a directory of the rank's own
    under ``directory`` (its scratch directory on its host), created here."""
    wanted = [var for var in FILES if var in env]
    if not wanted:
        return {}
    own = os.path.join(directory, f"horovod-rank{rank}")
    os.makedirs(own, mode=0o700, exist_ok=True)
    return {var: os.path.join(own, os.path.basename(FILES[var])) for var in wanted}


OPTION_NAMES = tuple(f.name for f in fields(HorovodOptions))
