"""Driver side: Hyperopt sweeps of distributed trials, one HorovodRunner job per trial.

* :mod:`.search` - the sweep loop: validate, resume, summarise;
* :mod:`.trial` - one trial: its child run, its job, its pruning judge, its result;
* :mod:`.pruning` - stopping trials early: the median and ASHA rules, one trial's judge;
* :mod:`.space` - search spaces; :mod:`.trials_store` - resume state; :mod:`.plot` - chart.
"""

from mlflow_hvd.sweep.pruning import AshaRule, MedianRule
from mlflow_hvd.sweep.search import SweepResult, sweep
from mlflow_hvd.sweep.space import space_from_json, validate_space

__all__ = ["AshaRule", "MedianRule", "SweepResult", "space_from_json", "sweep", "validate_space"]
