"""Driver side of tracking: the driver owns the job's MLflow run (:mod:`.run`), writes rank
0's metric, param and tag batches (:mod:`.relay`), records restarted attempts
(:mod:`.attempts`) and saves what never reached the server (:mod:`.undelivered`,
:mod:`.replay`)."""
