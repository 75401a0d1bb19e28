"""The shared protocol at the bottom of the package: what crosses a process boundary.

Wire messages and the job description (:mod:`.messages`), the authenticated channel's frames
and its client (:mod:`.channel`), tracking records and their one codec (:mod:`.records`),
and the checkpoint layout in a run's artifacts (:mod:`.checkpoint_layout`). Imports nothing
of the package above :mod:`mlflow_hvd.common`.
"""
