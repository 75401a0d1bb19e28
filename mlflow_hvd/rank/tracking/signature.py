"""A logged Keras model's signature, read from the inputs and outputs the model declares.

MLflow infers a signature only from an input example, by running the model on it (or from
a prediction the caller makes): that traces Keras' predict function, once per model. A
model built on ``keras.Input`` already declares the shape and dtype of what it takes and
returns, so no prediction is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def declared_signature(model: Any) -> Any:
    """``mlflow.models.ModelSignature`` of ``model``'s declared tensors, batch dimension
    ``-1``; None when the model declares none (a subclassed model) or takes several inputs
    (whose names the pyfunc caller would have to match).
    """
    from mlflow.models import ModelSignature

    try:
        inputs, outputs = list(model.inputs or ()), list(model.outputs or ())
    except (AttributeError, ValueError):  # Keras raises these for a model without them
        return None
    if len(inputs) != 1 or not outputs:
        return None
    input_schema = _schema(inputs)
    output_schema = _schema(outputs)
    if input_schema is None or output_schema is None:
        return None
    return ModelSignature(inputs=input_schema, outputs=output_schema)


def _schema(tensors: Sequence[Any]) -> Any:
    """A tensor schema (unnamed for one tensor, named by tensor otherwise); None if a dtype
    has no NumPy equivalent or the names are not unique."""
    import numpy as np
    from mlflow.types import ColSpec, Schema, TensorSpec

    names = [str(getattr(t, "name", "") or "") for t in tensors]
    if len(tensors) > 1 and (len(set(names)) != len(names) or "" in names):
        return None
    specs: list[ColSpec | TensorSpec] = []
    for tensor, name in zip(tensors, names, strict=True):
        try:
            dtype = np.dtype(str(tensor.dtype))
        except TypeError:  # e.g. bfloat16
            return None
        shape = tuple(-1 if d is None else int(d) for d in tensor.shape)
        specs.append(TensorSpec(dtype, shape, name if len(tensors) > 1 else None))
    return Schema(specs)
