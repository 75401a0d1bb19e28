"""Horovod's NCCL build (``HOROVOD_GPU_OPERATIONS=NCCL``) on a node without a GPU or driver:
the wheel GPU nodes get also serves CPU nodes. Run by ``scripts/end_tier.sh new`` with that
build installed in the new end's environment (``MLFLOW_HVD_TIER=new-end-gpu``; deselected
elsewhere): what it was built with, what it links against, and a 2-rank job under
HorovodRunner exact on Gloo's CPU collectives."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import workers

from mlflow_hvd import HorovodRunner, JobConfig
from mlflow_hvd.common.horovod_probe import load_extensions, nccl_version

pytestmark = pytest.mark.gpu_wheel

SITE = Path(sysconfig.get_paths()["purelib"])
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
EXTENSIONS = {"tensorflow": f"horovod/tensorflow/mpi_lib{SUFFIX}",
              "torch": f"horovod/torch/mpi_lib_v2{SUFFIX}"}


def _dynamic(path: Path) -> tuple[list[str], list[str]]:
    """``readelf -d``'s NEEDED libraries and RUNPATH entries of ``path``."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)
    runpath = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.+?)\]", out)
    return needed, [entry for found in runpath for entry in found.split(":")]


def test_both_extensions_load_with_gloo_cuda_and_the_environments_nccl() -> None:
    """In a process of each framework alone (TensorFlow's never imports PyTorch, which would
    have loaded NCCL first): NCCL is found beside Horovod in site-packages."""
    nccl = version("nvidia-nccl-cu13")
    for extension in EXTENSIONS:
        (check,) = load_extensions((extension,), 300)
        assert check.ok, check.describe()
        assert check.cuda, check.describe()
        assert nccl_version(check.nccl) == nccl, check.describe()
        assert f"Gloo, CUDA and NCCL {nccl}" in check.describe()


def test_what_the_nccl_build_links_against_is_what_docs_say() -> None:
    """NCCL shared, from the wheel's directory in site-packages; the CUDA runtime static in
    the TensorFlow extension, PyTorch's own in the PyTorch one; no path of the machine that
    built it."""
    for extension, relative in EXTENSIONS.items():
        needed, runpath = _dynamic(SITE / relative)
        assert "libnccl.so.2" in needed, (extension, needed)
        assert "$ORIGIN/../../nvidia/nccl/lib" in runpath, (extension, runpath)
        strays = [p for p in runpath if not p.startswith("$ORIGIN")]
        assert strays == [], f"{extension}: run paths of the build machine: {strays}"
        cudart = [lib for lib in needed if lib.startswith("libcudart")]
        assert cudart == ([] if extension == "tensorflow" else ["libcudart.so.13"]), needed


def test_a_node_without_nccl_is_told_what_to_install(tmp_path: Path) -> None:
    """The TensorFlow extension copied away from site-packages (as on a node whose
    environment lacks NVIDIA's NCCL wheel): it does not load, and the check says why and
    what to install."""
    copy = tmp_path / "elsewhere"
    shutil.copytree(SITE / "horovod", copy / "horovod")
    code = (f"import sys; sys.path.insert(0, {str(copy)!r}); from mlflow_hvd.common."
            "horovod_probe import load_extensions; import json; (c,) = load_extensions("
            "('tensorflow',), 300); print(json.dumps([c.ok, c.describe()]))")
    # the probe's own interpreter must find the copy first: PYTHONPATH reaches it
    path = os.pathsep.join(filter(None, (str(copy), os.environ.get("PYTHONPATH"))))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=360, check=False, env={**os.environ, "PYTHONPATH": path})
    ok, described = json.loads(done.stdout.strip().splitlines()[-1])
    assert not ok
    assert "libnccl.so.2: cannot open shared object file" in described, described
    assert "pip install nvidia-nccl-cu13" in described, described


def test_a_two_rank_cpu_job_on_the_nccl_build_is_exact(store: str) -> None:
    """Gloo's CPU collectives through both extensions of the NCCL build, under HorovodRunner."""
    runner = HorovodRunner(np=-2, job=JobConfig(stop_grace=2))
    out: dict[str, Any] = runner.run(workers.torch_collectives, steps=3)
    assert (out["sum"], out["mean"], out["broadcast"]) == ([3.0], [0.5], [100.0])
    assert out["gathered"] == [0, 1, 10, 11]
    weights_0, weights_1 = out["weights"]
    assert weights_0 == weights_1
    tf_out = HorovodRunner(np=-2, job=JobConfig(stop_grace=2)).run(workers.collectives)
    assert (tf_out["size"], tf_out["sum"], tf_out["mean"]) == (2, [3.0], [0.5])
    assert tf_out["gathered"] == [0, 1, 10, 11] and tf_out["broadcast"] == [100.0]
