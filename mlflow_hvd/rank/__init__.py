"""Rank side: what runs inside each rank's worker process.

* :mod:`.worker` - the entry point (``python -m mlflow_hvd.rank.worker``): reads its
  bootstrap from stdin, runs the user's function, reports the outcome.
* :mod:`.context` - what user code can ask of the run (``log_to_driver``).

Nothing here imports the driver stack (no rendezvous server, no Spark): a rank pays only
for what it uses.
"""
