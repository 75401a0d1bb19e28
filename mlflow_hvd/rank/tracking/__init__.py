"""Rank side of tracking: what rank 0 logs and how it gets there. The public functions
(:mod:`.api`, re-exported as :mod:`mlflow_hvd.tracking`), the delivery thread
(:mod:`.delivery`) and how it sends a batch (:mod:`.sender`), checkpoints as artifacts
(:mod:`.checkpoints`), and what a logged model carries (:mod:`.requirements`,
:mod:`.signature`). Every other rank logs nothing."""
