"""Horovod built against the installed TensorFlow and PyTorch (mlflow_hvd.cli.horovod), in
environments mlflow_hvd did not make. Real package metadata, real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_entry_point
from test_compat import _fake_distribution

from mlflow_hvd.cli import horovod


def test_an_environment_with_its_horovod_is_seen_as_ready_without_importing_tensorflow() -> None:
    proc = run_entry_point("mlflow_hvd.cli.horovod")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Horovod 0.28.1 for TensorFlow ")
    assert proc.stdout.rstrip().endswith(f"is installed ({Path(sys.prefix) / horovod.MARKER})")
    marker = json.loads((Path(sys.prefix) / horovod.MARKER).read_text())
    assert marker == {"horovod": "0.28.1", "tensorflow": horovod.target().tensorflow,
                      "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
                      "cpu": horovod.cpu_id(), "torch": horovod.target().torch}


def test_check_loads_horovod_as_a_rank_does_and_reports_gloo() -> None:
    proc = run_entry_point("mlflow_hvd.cli.horovod", "--check")
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch = horovod.target().torch
    assert proc.stdout.strip().splitlines()[-1] == (
        f"Horovod 0.28.1 with Gloo and TensorFlow {horovod.target().tensorflow}"
        + (f" and PyTorch {torch}" if torch else ""))


def test_the_main_environment_builds_horovod_with_pytorch_and_its_check_build_says_so() -> None:
    """horovodrun's own report of the build: Gloo, TensorFlow and PyTorch, no MPI."""
    assert horovod.target().torch == "2.13.0+cpu"
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "horovodrun"),
                           "--check-build"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ticked = {line.split("]", 1)[1].strip() for line in proc.stdout.splitlines()
              if line.strip().startswith("[X]")}
    assert {"TensorFlow", "PyTorch", "Gloo"} <= ticked and "MPI" not in ticked, proc.stdout


def _sdist_tree(root: Path, top: str, torch: str) -> Path:
    (root / "horovod" / "torch").mkdir(parents=True)
    top_file = "\n" * 18 + top + "\nset(CMAKE_CXX_STANDARD_REQUIRED ON)\n"
    (root / "CMakeLists.txt").write_text(top_file)
    (root / "horovod" / "torch" / "CMakeLists.txt").write_text("\n" * 66 + torch + "\n")
    return root


def test_the_cxx17_patch_changes_exactly_the_two_released_lines(tmp_path: Path) -> None:
    tree = _sdist_tree(tmp_path, "set(CMAKE_CXX_STANDARD 14)", "    set(CMAKE_CXX_STANDARD 14)")
    horovod.patch_cxx17(tree)
    top = (tree / "CMakeLists.txt").read_text().split("\n")
    assert top[18] == "set(CMAKE_CXX_STANDARD 17)" and top[19].endswith("REQUIRED ON)")
    assert (tree / "horovod/torch/CMakeLists.txt").read_text().split("\n")[66] == (
        "    set(CMAKE_CXX_STANDARD 17)")


def test_the_cxx17_patch_refuses_a_source_it_was_not_written_for(tmp_path: Path) -> None:
    tree = _sdist_tree(tmp_path, "set(CMAKE_CXX_STANDARD 14)", "    set(CMAKE_CXX_STANDARD 11)")
    with pytest.raises(horovod.InstallError) as info:
        horovod.patch_cxx17(tree)
    assert str(info.value) == (
        "cannot apply the C++17 patch for PyTorch to Horovod 0.28.1: line 67 of "
        "horovod/torch/CMakeLists.txt is '    set(CMAKE_CXX_STANDARD 11)', expected "
        "'    set(CMAKE_CXX_STANDARD 14)'")


def test_the_cache_key_names_both_frameworks() -> None:
    both = horovod.Target("0.28.1", "2.18.1", "3.11", "x86_64-abc", "2.13.0+cpu")
    assert both.name == "horovod-0.28.1-tf2.18.1-torch2.13.0+cpu-py3.11-x86_64-abc"
    assert both.flags()["HOROVOD_WITH_PYTORCH"] == "1"
    tf_only = horovod.Target("0.28.1", "2.16.2", "3.12", "x86_64-abc")
    assert tf_only.name == "horovod-0.28.1-tf2.16.2-py3.12-x86_64-abc"  # as before PyTorch
    assert tf_only.flags()["HOROVOD_WITHOUT_PYTORCH"] == "1"


def test_a_tensorflow_outside_the_range_is_refused_before_any_build(tmp_path: Path) -> None:
    fake = _fake_distribution(tmp_path / "site", "tensorflow", "2.19.0")
    proc = run_entry_point("mlflow_hvd.cli.horovod", path=fake,
                env={"MLFLOW_HVD_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: TensorFlow 2.19.0 (installed here) is not supported: mlflow_hvd works with "
        "TensorFlow >=2.16,<2.19 (2.16 is the first whose tf.keras is Keras 3; 2.18 the last "
        "Horovod 0.28.1 builds against). Install a version in that range")
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_a_wheel_without_the_pytorch_extension_is_refused(tmp_path: Path) -> None:
    import sysconfig
    import zipfile

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    wheel = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:  # the extension landed outside the package
        zf.writestr(f"horovod/tensorflow/mpi_lib{suffix}", b"")
        zf.writestr(f"root/build/horovod/torch/mpi_lib_v2{suffix}", b"")
    t = horovod.Target("0.28.1", "2.18.1", "3.11", "x86_64-abc", "2.13.0+cpu")
    with pytest.raises(horovod.InstallError) as info:
        horovod.check_wheel(wheel, t)
    assert str(info.value) == (
        "the Horovod wheel built for TensorFlow 2.18.1 and PyTorch 2.13.0+cpu lacks "
        f"horovod/torch/mpi_lib_v2{suffix}; nothing was cached or installed")
    horovod.check_wheel(wheel, horovod.Target("0.28.1", "2.18.1", "3.11", "x86_64-abc"))
