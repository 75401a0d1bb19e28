"""Horovod built against the installed TensorFlow and PyTorch (mlflow_hvd.cli.horovod), in
environments mlflow_hvd did not make. Real package metadata, real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import run_entry_point
from test_compat import _fake_distribution

from mlflow_hvd.cli import horovod, horovod_patches


def test_an_environment_with_its_horovod_is_seen_as_ready_without_importing_tensorflow() -> None:
    proc = run_entry_point("mlflow_hvd.cli.horovod")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Horovod 0.28.1 for TensorFlow ")
    assert proc.stdout.rstrip().endswith(f"is installed ({Path(sys.prefix) / horovod.MARKER})")
    marker = json.loads((Path(sys.prefix) / horovod.MARKER).read_text())
    assert marker == {"horovod": "0.28.1", "tensorflow": horovod.target().tensorflow,
                      "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
                      "cpu": horovod.cpu_id(), "torch": horovod.target().torch,
                      "patches": horovod.target().patches}


def test_check_loads_horovod_as_a_rank_does_and_reports_gloo() -> None:
    proc = run_entry_point("mlflow_hvd.cli.horovod", "--check")
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch = horovod.target().torch
    assert proc.stdout.strip().splitlines()[-1] == (
        f"Horovod 0.28.1 with Gloo and TensorFlow {horovod.target().tensorflow}"
        + (f" and PyTorch {torch}" if torch else ""))


@pytest.mark.beside  # horovodrun's own check: ~25 s of imports in its own processes
def test_the_main_environment_builds_horovod_with_pytorch_and_its_check_build_says_so() -> None:
    """horovodrun's own report of the build: Gloo, TensorFlow and PyTorch, no MPI."""
    assert horovod.target().torch == "2.13.0+cpu"
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "horovodrun"),
                           "--check-build"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ticked = {line.split("]", 1)[1].strip() for line in proc.stdout.splitlines()
              if line.strip().startswith("[X]")}
    assert {"TensorFlow", "PyTorch", "Gloo"} <= ticked and "MPI" not in ticked, proc.stdout


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Horovod's sdist from the package index, checked against its sha256 as a build is."""
    return horovod.download_sdist(tmp_path_factory.mktemp("sdist"))


@pytest.fixture(scope="module")
def released(sdist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _unpacked(sdist, tmp_path_factory.mktemp("released"))


@pytest.fixture(scope="module")
def patched_trees() -> dict[tuple[str, ...], Path]:
    return {}


def _unpacked(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar:
        tar.extractall(into, filter="data")
    (source,) = into.iterdir()
    return source


@pytest.mark.parametrize(("tensorflow", "torch", "names"), [
    ("2.16.2", "", []), ("2.18.1", "", []), ("2.18.1", "2.13.0+cpu", ["cxx17"]),
    ("2.19.1", "", ["xla-ops"]), ("2.20.0", "", ["xla-ops"]),
    ("2.21.0", "", ["xla-ops"]), ("2.21.0", "2.13.0+cpu", ["cxx17", "xla-ops"]),
    ("2.21.0rc1", "2.14.1", ["cxx17", "xla-ops"]),
])
def test_each_versions_patches_apply_to_the_released_sdist_and_change_only_their_lines(
        sdist: Path, released: Path, patched_trees: dict[tuple[str, ...], Path],
        tmp_path_factory: pytest.TempPathFactory, tensorflow: str, torch: str,
        names: list[str]) -> None:
    patches = horovod_patches.needed(tensorflow, torch)
    assert [p.name for p in patches] == names
    if not patches:  # the build compiles the sdist as released
        return
    key = tuple(names)
    if key not in patched_trees:  # versions that need the same patches share one tree
        out = tmp_path_factory.mktemp("patched")
        patched_trees[key] = _unpacked(horovod.patched_sdist(sdist, out / "sdist", patches),
                                       out / "tree")
    patched = patched_trees[key]
    files = sorted(p.relative_to(released) for p in released.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(patched) for p in patched.rglob("*") if p.is_file())
    changed = {}
    for name in files:
        if (released / name).read_bytes() != (patched / name).read_bytes():
            before = (released / name).read_text().split("\n")
            after = (patched / name).read_text().split("\n")
            assert len(before) == len(after), name
            changed.update({(str(name), n + 1): (a, b)
                            for n, (a, b) in enumerate(zip(before, after, strict=True))
                            if a != b})
    expected = {(e.file, e.line): (e.released, e.patched) for p in patches for e in p.edits}
    assert changed == expected
    if "xla-ops" in names:  # the XLA ops' file compiles to nothing on TensorFlow >= 2.19
        assert changed[("horovod/tensorflow/xla_mpi_ops.cc", 23)][1] == (
            "#if TENSORFLOW_VERSION >= 2006000000 && TENSORFLOW_VERSION < 2019000000")


def test_a_patch_refuses_a_source_it_was_not_written_for(sdist: Path, tmp_path: Path) -> None:
    source = _unpacked(sdist, tmp_path)
    torch_cmake = source / "horovod/torch/CMakeLists.txt"
    torch_cmake.write_text(torch_cmake.read_text().replace(
        "    set(CMAKE_CXX_STANDARD 14)", "    set(CMAKE_CXX_STANDARD 11)"))
    top = (source / "CMakeLists.txt").read_text()
    with pytest.raises(horovod.InstallError) as info:
        horovod_patches.apply(source, horovod_patches.needed("2.21.0", "2.13.0+cpu"), "0.28.1")
    assert str(info.value) == (
        "cannot apply the cxx17 patch to Horovod 0.28.1: line 67 of "
        "horovod/torch/CMakeLists.txt is '    set(CMAKE_CXX_STANDARD 11)', expected "
        "'    set(CMAKE_CXX_STANDARD 14)' (another version or a modified sdist); nothing was "
        "built")
    assert (source / "CMakeLists.txt").read_text() == top  # checked before anything is written


def test_the_cache_key_names_both_frameworks_and_the_patches() -> None:
    both = horovod.Target("0.28.1", "2.18.1", "3.11", "x86_64-abc", "2.13.0+cpu", "cxx17")
    assert both.name.startswith("horovod-0.28.1-tf2.18.1-torch2.13.0+cpu-py3.11-x86_64-abc-p")
    assert both.flags()["HOROVOD_WITH_PYTORCH"] == "1"
    tf_only = horovod.Target("0.28.1", "2.16.2", "3.12", "x86_64-abc")
    assert tf_only.name == "horovod-0.28.1-tf2.16.2-py3.12-x86_64-abc"  # the sdist unchanged
    assert tf_only.flags()["HOROVOD_WITHOUT_PYTORCH"] == "1"
    newest = horovod.Target("0.28.1", "2.21.0", "3.11", "x86_64-abc", "2.13.0+cpu",
                            "cxx17,xla-ops")
    assert [p.name for p in newest.patch_set()] == ["cxx17", "xla-ops"]
    assert newest.name.rsplit("-p", 1)[1] != both.name.rsplit("-p", 1)[1]


def test_a_tensorflow_outside_the_range_is_refused_before_any_build(tmp_path: Path) -> None:
    fake = _fake_distribution(tmp_path / "site", "tensorflow", "2.22.0")
    proc = run_entry_point("mlflow_hvd.cli.horovod", path=fake,
                env={"MLFLOW_HVD_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "error: TensorFlow 2.22.0 (installed here) is not supported: mlflow_hvd works with "
        "TensorFlow >=2.16,<2.22 (2.16 is the first whose tf.keras is Keras 3; 2.21 the newest "
        "released, which Horovod 0.28.1 builds against with the patches of "
        "mlflow_hvd/cli/horovod_patches.py). Install a version in that range")
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_tensorflow_2_20_beside_protobuf_7_is_refused_before_any_build(tmp_path: Path) -> None:
    fake = _fake_distribution(tmp_path / "site", "tensorflow", "2.20.0")
    _fake_distribution(fake, "protobuf", "7.36.2")
    proc = run_entry_point("mlflow_hvd.cli.horovod", path=fake,
                env={"MLFLOW_HVD_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith(
        "error: TensorFlow 2.20.0 (installed here) does not work with protobuf 7.36.2"), proc.stderr
    assert "Install 'protobuf<7'" in proc.stderr
    assert not (tmp_path / "cache").exists()


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
