"""Rank side, Keras 3: the distributed optimizer and gradient tape, variable broadcast and
learning-rate scaling, on ``horovod.tensorflow`` collectives.

:func:`DistributedOptimizer` and :func:`DistributedGradientTape` take Horovod's keyword
arguments. Those this implementation honours: ``compression``, ``op`` (``Average``/``Sum``),
``gradient_predivide_factor``, ``device_dense``; accepted with no effect on Keras 3:
``name``, ``device_sparse``, ``sparse_as_dense`` (Keras 3 gradients are dense),
``scale_local_gradients``. The others are refused with the way to get the same effect.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from mlflow_hvd.errors import ConfigurationError

_WRAPPED = "_mlflow_hvd_distributed"


def scale_learning_rate(learning_rate: float, size: int | None = None) -> float:
    """The seed's step 5: scale the single-process learning rate by the number of workers.

    With ``N`` ranks each seeing its own batch, the effective batch is ``N`` times larger.
    """
    if not learning_rate > 0:
        raise ConfigurationError(f"learning_rate must be > 0, got {learning_rate!r}")
    return float(learning_rate) * (size if size is not None else hvd.size())


class _Reduction:
    """How gradients are combined across ranks (Horovod's optimizer/tape keyword arguments)."""

    def __init__(
        self,
        where: str,
        *,
        compression: Any = None,
        op: Any = None,
        gradient_predivide_factor: float = 1.0,
        device_dense: str = "",
        backward_passes_per_step: int = 1,
        average_aggregated_gradients: bool = False,
        num_groups: int = 0,
        groups: Any = None,
        process_set: Any = None,
        **accepted: Any,
    ) -> None:
        unknown = set(accepted) - {
            "name",
            "device_sparse",
            "sparse_as_dense",
            "scale_local_gradients",
        }
        if unknown:
            raise ConfigurationError(
                f"{where} got unexpected keyword arguments {sorted(unknown)}; it takes "
                "Horovod's: compression, op, gradient_predivide_factor, device_dense, "
                "device_sparse, sparse_as_dense, name, backward_passes_per_step, num_groups, "
                "groups, process_set"
            )
        op = hvd.Average if op is None else op
        if op not in (hvd.Average, hvd.Sum):
            raise ConfigurationError(
                f"{where}: op={op!r} is not supported here (Adasum needs an MPI build); use "
                "hvd.Average (default) or hvd.Sum"
            )
        if backward_passes_per_step != 1 or average_aggregated_gradients:
            raise ConfigurationError(
                f"{where}: backward_passes_per_step={backward_passes_per_step} is not "
                "supported; accumulate gradients with Keras 3 itself: pass "
                "gradient_accumulation_steps=N to the optimizer you wrap (it averages the N "
                "steps, i.e. average_aggregated_gradients=True)"
            )
        if num_groups or groups is not None:
            raise ConfigurationError(
                f"{where}: num_groups/groups are not supported: all gradients are reduced in "
                "one fused grouped_allreduce per step"
            )
        if process_set is not None and process_set is not hvd.global_process_set:
            raise ConfigurationError(
                f"{where}: only the global process set is supported (every rank takes part)"
            )
        if gradient_predivide_factor != 1.0 and op is not hvd.Average:
            raise ConfigurationError(f"{where}: gradient_predivide_factor needs op=hvd.Average")
        self.compression = compression or hvd.Compression.none
        self.op = op
        self.predivide = float(gradient_predivide_factor)
        self.device_dense = device_dense

    def __call__(self, grads: Sequence[Any]) -> list[Any]:
        """Combine ``grads`` across ranks; ``None`` entries (unused variables) stay None."""
        out = list(grads)
        if hvd.size() == 1:
            return out
        present = [i for i, g in enumerate(out) if g is not None]
        tensors = [tf.convert_to_tensor(out[i]) for i in present]
        if self.predivide != 1.0:  # Horovod's scheme: sum of grads / f, then * f / size
            reduced = hvd.grouped_allreduce(
                tensors,
                op=hvd.Sum,
                compression=self.compression,
                prescale_factor=1.0 / self.predivide,
                postscale_factor=self.predivide / hvd.size(),
                device_dense=self.device_dense,
            )
        else:
            reduced = hvd.grouped_allreduce(
                tensors,
                op=self.op,
                compression=self.compression,
                device_dense=self.device_dense,
            )
        for i, g in zip(present, reduced, strict=True):
            out[i] = g
        return out


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer, **horovod_kwargs: Any
) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that ``apply`` first combines gradients over all ranks.

    Takes Horovod's keyword arguments (see the module docstring). The wrapper is a subclass
    created on the fly with the same class name, module and config as the original, so a
    model saved with it (``model.save``, MLflow checkpoints, ``mlflow.tensorflow.log_model``)
    loads back as the plain optimizer, without Horovod.

    Returns:
        The same optimizer object, with its class swapped for the distributed subclass.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigurationError(
            f"DistributedOptimizer needs a keras.optimizers.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    reduce = _Reduction("DistributedOptimizer", **horovod_kwargs)
    if getattr(optimizer, _WRAPPED, False):
        return optimizer
    base = type(optimizer)

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        return base.apply(self, reduce(list(grads)), trainable_variables)

    cls = type(base.__name__, (base,), {"apply": apply, _WRAPPED: True})
    cls.__module__ = base.__module__
    cls.__qualname__ = base.__qualname__
    optimizer.__class__ = cls
    return optimizer


class _DistributedTape:
    """A ``tf.GradientTape`` whose ``gradient`` is combined across ranks."""

    def __init__(self, tape: tf.GradientTape, reduce: _Reduction) -> None:
        self._tape = tape
        self._reduce = reduce

    def gradient(
        self, target: Any, sources: Any, output_gradients: Any = None, **kwargs: Any
    ) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads, expand_composites=False)
        return tf.nest.pack_sequence_as(grads, self._reduce(flat))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> _DistributedTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)


def DistributedGradientTape(gradtape: tf.GradientTape, **horovod_kwargs: Any) -> Any:
    """Horovod's ``DistributedGradientTape`` for Keras 3 variables: ``gradient`` returns
    gradients averaged over all ranks (one fused ``grouped_allreduce``).

    Takes Horovod's keyword arguments (see the module docstring).
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise ConfigurationError(
            f"DistributedGradientTape needs a tf.GradientTape, got {type(gradtape).__name__}"
        )
    return _DistributedTape(gradtape, _Reduction("DistributedGradientTape", **horovod_kwargs))


def broadcast_variables(variables: list[Any], root_rank: int = 0) -> None:
    """Overwrite ``variables`` on every rank with their values on ``root_rank``."""
    if variables and hvd.size() > 1:
        hvd.broadcast_variables([getattr(v, "value", v) for v in variables], root_rank)


def broadcast_global_variables(root_rank: int, model: keras.Model | None = None) -> None:
    """Horovod's ``broadcast_global_variables``: Keras 3 has no global variables, so pass
    the model (its weights and built optimizer state are broadcast from ``root_rank``)."""
    if model is None:
        raise ConfigurationError(
            "broadcast_global_variables: Keras 3 has no global variables; call "
            "broadcast_global_variables(root_rank, model) after the model and its optimizer "
            "are built, or use callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit"
        )
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    broadcast_variables(variables, root_rank)


def load_model(
    filepath: str,
    custom_optimizers: Sequence[type] | None = None,
    custom_objects: dict[str, Any] | None = None,
    compression: Any = None,
) -> keras.Model:
    """Horovod's ``load_model``: load a saved Keras model and wrap its optimizer with
    :func:`DistributedOptimizer`."""
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    if getattr(model, "optimizer", None) is not None:
        DistributedOptimizer(model.optimizer, compression=compression)
    return model
