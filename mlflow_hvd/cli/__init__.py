"""Command-line entry points (driver side), called by the MLproject and ``make demo``.

* ``python -m mlflow_hvd.cli.train`` - one distributed training run (entry point ``main``);
* ``python -m mlflow_hvd.cli.sweep`` - a Hyperopt sweep of such runs (entry point ``sweep``).

Both take the training function as ``--train path/to/file.py:function`` (or
``package.module:function``); the default is the digits example in ``examples/``.
"""
