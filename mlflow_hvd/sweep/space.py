"""Driver side: search spaces, checking a hyperopt space and building one from JSON."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlflow_hvd.errors import ConfigurationError


def validate_space(space: Mapping[str, Any], seed: int = 0) -> None:
    """Check the search space can be sampled before any trial starts.

    Raises:
        ConfigurationError: Not a non-empty mapping of names to hyperopt expressions (or
            constants), or sampling it fails; the message names the culprit.
    """
    from hyperopt.pyll import stochastic

    if not isinstance(space, Mapping) or not space:
        raise ConfigurationError(
            "space must be a non-empty dict of parameter names to hyperopt expressions, e.g. "
            "{'learning_rate': hp.loguniform('learning_rate', -7, -2)}; got "
            f"{type(space).__name__}"
        )
    for name, expr in space.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"space keys must be non-empty strings, got {name!r}")
        try:
            stochastic.sample(expr, rng=__import__("numpy").random.default_rng(seed))
        except Exception as exc:
            raise ConfigurationError(
                f"space[{name!r}] cannot be sampled: {type(exc).__name__}: {exc}"
            ) from exc


def space_from_json(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Build a hyperopt space from a JSON-able description.

    ``{"learning_rate": ["loguniform", -7, -2], "batch_size": ["choice", [16, 32, 64]],
    "epochs": ["quniform", 2, 6, 1]}``: each value is ``[hp function name, *arguments]``.
    ``quniform``/``qloguniform`` values that are whole numbers become ints.
    """
    from hyperopt import hp

    allowed = {"uniform", "loguniform", "quniform", "qloguniform", "normal", "choice", "randint"}
    space: dict[str, Any] = {}
    for name, desc in spec.items():
        if not isinstance(desc, list | tuple) or not desc or desc[0] not in allowed:
            raise ConfigurationError(
                f"search space entry {name!r} must be [kind, *args] with kind one of "
                f"{sorted(allowed)}, got {desc!r}"
            )
        kind, *args = desc
        try:
            space[name] = getattr(hp, kind)(name, *args)
        except Exception as exc:
            raise ConfigurationError(f"search space entry {name!r}: {exc}") from exc
    validate_space(space)
    return space


def plain(value: Any) -> Any:
    """numpy scalars to Python; whole-number floats from q-distributions to int."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value
