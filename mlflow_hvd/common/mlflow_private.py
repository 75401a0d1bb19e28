"""The names mlflow_hvd reads from MLflow that are not MLflow's public API, gathered here:
each with why no public API does it, and the MLflow versions it was checked on (the tested
range, 3.10.0 and 3.17.2: docs/install.md, Compatibility). A new MLflow that moves one fails
here, in one place, at first use.
"""

from __future__ import annotations

from typing import Any


def tracking_uri_was_set() -> bool:
    """Whether the process chose a tracking URI (``MLFLOW_TRACKING_URI`` or
    ``mlflow.set_tracking_uri``) rather than running on MLflow's default store.

    Why private: ``mlflow.get_tracking_uri()`` returns the default when none was chosen and
    cannot tell the two apart. ``mlflow.tracking._tracking_service.utils
    .is_tracking_uri_set``: checked on 3.10.0 and 3.17.2."""
    from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

    return bool(is_tracking_uri_set())


def forget_active_run(run_id: str) -> None:
    """Pop ``run_id`` off this thread's active-run stack, if it is on top, without a server
    call.

    Why private: ``mlflow.end_run()`` pops it too, but first calls ``set_terminated`` on the
    tracking server again — after the driver ended the run under its own deadline, against
    a server that may be down. ``mlflow.tracking.fluent._active_run_stack`` (a
    ``ThreadLocalVariable`` of a list): checked on 3.10.0 and 3.17.2."""
    from mlflow.tracking import fluent

    stack = fluent._active_run_stack.get()
    if stack and stack[-1].info.run_id == run_id:
        stack.pop()


def dataset_source_type(source: Any) -> str:
    """The type name of a dataset's source (``"delta_table"``, ``"spark"``, ...), as the
    run's dataset inputs record it.

    Why private: the public ``Dataset.to_dict()`` holds it, but computes the dataset's
    profile first, which for a Spark DataFrame runs a Spark job (``countApprox``, up to
    5 s) for a row count the driver already has. ``DatasetSource._get_source_type()``:
    checked on 3.10.0 and 3.17.2."""
    return str(source._get_source_type())


def enabled_autologging() -> list[str]:
    """The autologging integrations turned on in this process (``"mlflow"`` for
    ``mlflow.autolog()``, else flavors: ``"tensorflow"``, ``"sklearn"``, ...).

    Why private: MLflow has no public list of them; each flavor's ``autolog`` registers its
    settings in ``mlflow.utils.autologging_utils.AUTOLOGGING_INTEGRATIONS``, and
    ``autologging_is_disabled(name)`` of the same module (documented nowhere) says whether
    it is off. Checked on 3.10.0 and 3.17.2."""
    from mlflow.utils.autologging_utils import AUTOLOGGING_INTEGRATIONS, autologging_is_disabled

    return [name for name in list(AUTOLOGGING_INTEGRATIONS) if not autologging_is_disabled(name)]
