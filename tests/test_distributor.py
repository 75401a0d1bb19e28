"""``mlflow_hvd.TorchDistributor``: pyspark's TorchDistributor API on HorovodRunner (a
function with positional arguments on driver ranks, a script with its command line on Spark
barrier tasks), and the input it refuses before any process starts."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import workers

from mlflow_hvd import ConfigurationError, TorchDistributor


def ddp_with_positional(scale: float, steps: int, tag: str = "") -> dict[str, Any]:
    """A TorchDistributor-style function: positional arguments, DDP; rank 0's value."""
    out = workers.ddp_as_pytorch_writes_it(steps=steps)
    return {"scale": scale, "tag": tag, "ranks": out["ranks"],
            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}


@pytest.mark.slow
def test_a_function_with_positional_arguments_runs_on_driver_ranks_and_rank_0s_value_returns(
        ) -> None:
    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    out = distributor.run(ddp_with_positional, 0.5, 2, tag="x")
    # on the driver, use_gpu=False leaves its GPUs as they are (pyspark's does too)
    assert (out["scale"], out["tag"], out["cuda"]) == (
        0.5, "x", os.environ.get("CUDA_VISIBLE_DEVICES"))
    ranks = out["ranks"]
    assert [r["env"]["RANK"] for r in ranks] == ["0", "1"]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert distributor.runner.num_processor == -2


SCRIPT = '''
import argparse, json, os, sys
import torch, torch.distributed as dist
parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser.add_argument("--steps", type=int)
args = parser.parse_args()
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(args.steps):
    opt.zero_grad(); model(torch.ones(4, 2) * dist.get_rank()).sum().backward(); opt.step()
with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"argv": sys.argv, "name": __name__, "world": dist.get_world_size(),
               "weight": model.module.weight.tolist()}, f)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_a_script_runs_with_its_command_line_on_spark_barrier_tasks(spark: Any,
                                                                    tmp_path: Path) -> None:
    """As ``torchrun train.py --out ... --steps 2`` in each task: the script as __main__, its
    arguments as strings (an int given is passed as its text); None returns."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "out"
    out.mkdir()
    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    assert distributor.run(str(script), "--out", str(out), "--steps", 2) is None
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for view in seen:
        assert view["argv"] == [str(script), "--out", str(out), "--steps", "2"]
        assert (view["name"], view["world"]) == ("__main__", 2)
    assert seen[0]["weight"] == seen[1]["weight"]


def test_input_pyspark_refuses_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigurationError, match=(
                rf"^TorchDistributor\(num_processes={bad!r}\): the number of processes must "
                r"be a positive integer \(one per GPU with use_gpu=True\)$")):
            TorchDistributor(num_processes=bad, use_gpu=False)
    with pytest.raises(ConfigurationError, match=(
            r"^TorchDistributor\(use_gpu=True, local_mode=True\) but this machine has no GPU "
            r"\(no /dev/nvidia\* device\): pass use_gpu=False")):
        TorchDistributor(num_processes=2)  # pyspark's defaults: local_mode, use_gpu
    from mlflow_hvd.backends.spark.api import active_session

    # the fast tier runs no JVM; a run of the whole suite in one process may have the tests'
    # session (no GPU resources) active
    where = ("the active SparkSession has no spark.task.resource.gpu.amount"
             if active_session() is not None else "there is no active SparkSession to say so")
    with pytest.raises(ConfigurationError, match=(
            r"^TorchDistributor\(use_gpu=True, local_mode=False\) needs a GPU for each task, "
            rf"and {re.escape(where)}: start the session with "
            r"spark\.task\.resource\.gpu\.amount=1")):
        TorchDistributor(num_processes=2, local_mode=False)
    with pytest.raises(ConfigurationError, match=(
            r"^TorchDistributor\(\) takes no option 'nproc_per_node' \(options are grouped")):
        TorchDistributor(num_processes=2, use_gpu=False, nproc_per_node=2)
    with pytest.raises(ConfigurationError, match=r"\(np is num_processes here\)$"):
        TorchDistributor(num_processes=2, use_gpu=False, np=2)
    distributor = TorchDistributor(num_processes=2, use_gpu=False)
    missing = tmp_path / "nowhere.py"
    with pytest.raises(ConfigurationError, match=(
            rf"^TorchDistributor\.run\('{missing}'\): no such file on the driver\. The script "
            r"is read here and sent to every process")):
        distributor.run(str(missing), "--lr", "0.1")
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    with pytest.raises(ConfigurationError, match=(
            rf"^TorchDistributor\.run\('{script}', \.\.\.\) was given keyword arguments \(lr\): "
            r"a script takes its command line only")):
        distributor.run(str(script), lr=0.1)
    with pytest.raises(ConfigurationError, match=(
            r"^TorchDistributor\.run\(ddp_with_positional, \.\.\.\): missing a required "
            r"argument: 'steps' \(its signature: ddp_with_positional\(scale: 'float', "
            r"steps: 'int', tag: 'str' = ''\)")):
        distributor.run(ddp_with_positional, 0.5)
    with pytest.raises(ConfigurationError, match=r"a function or the path of a script, got int"):
        distributor.run(3)


# values that differ from run to run, or name where the store listens: compared by presence
PER_RUN = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


@pytest.mark.slow
@pytest.mark.parametrize("local_mode", [False, True], ids=["tasks", "driver"])
def test_each_process_sees_the_torchrun_variables_pysparks_torchdistributor_gives_it(
        spark: Any, local_mode: bool) -> None:
    """On the same local-cluster, every process sees the torchrun variables pyspark's
    TorchDistributor gives it. local_mode=False: each task a node of its own (LOCAL_RANK 0,
    its task as GROUP_RANK and NODE_RANK), no GPU. local_mode=True: one torchrun of both
    processes on the driver (LOCAL_RANK 0 and 1 of node 0), the driver's GPUs left as they
    are. What differs per run (the store's address and port, the run id, the error file)
    is there in both."""
    from pyspark import cloudpickle
    from pyspark.ml.torch.distributor import TorchDistributor as Pyspark

    cloudpickle.register_pickle_by_value(workers)  # its torchrun processes cannot import it
    try:
        theirs = Pyspark(num_processes=2, local_mode=local_mode, use_gpu=False).run(
            workers.torchrun_views)
    finally:
        cloudpickle.unregister_pickle_by_value(workers)
    ours = TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False).run(
        workers.torchrun_views)

    def comparable(view: dict[str, str | None]) -> dict[str, str | None]:
        return {k: (v is not None) if k in PER_RUN else v for k, v in view.items()}

    assert [comparable(v) for v in ours] == [comparable(v) for v in theirs], (ours, theirs)
    # what Lightning indexes its devices with
    assert [v["LOCAL_RANK"] for v in theirs] == (["0", "1"] if local_mode else ["0", "0"])
