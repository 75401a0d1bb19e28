"""The sweep's search spaces (sweep/space.py): what is refused, by name."""

from __future__ import annotations

import pytest

from mlflow_hvd.errors import ConfigurationError
from mlflow_hvd.sweep.space import validate_space


def test_space_keys_must_be_names() -> None:
    from hyperopt import hp

    with pytest.raises(ConfigurationError) as info:
        validate_space({"": hp.uniform("x", 0, 1)})
    assert str(info.value) == "space keys must be non-empty strings, got ''"


def test_search_space_entry_with_bad_arguments() -> None:
    from mlflow_hvd.sweep import space_from_json

    with pytest.raises(ConfigurationError) as info:
        space_from_json({"x": ["choice", 5]})
    assert str(info.value) == "search space entry 'x': object of type 'int' has no len()"
