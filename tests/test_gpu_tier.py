"""What of the GPU tier runs without a GPU: `make test-gpu`'s refusal (one line, exit 77,
nothing prepared), the nvidia-smi discovery script Spark runs, and that the tier's tests are
collected by their tier and by no other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

SCRIPT = REPO / "examples" / "get_gpus_resources.sh"


def _fake_smi(bin_dir: Path, body: str) -> dict[str, str]:
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}


@pytest.mark.parametrize(("smi", "reason"), [
    (None, "nvidia-smi is not on PATH"),
    ("echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver\"; "
     "exit 9", "nvidia-smi failed: NVIDIA-SMI has failed because it couldn't communicate with "
     "the NVIDIA driver"),
    ("exit 0", "nvidia-smi lists no GPU"),
])
def test_the_gpu_tier_without_a_gpu_says_so_in_one_line_and_is_not_a_pass(
        tmp_path: Path, smi: str | None, reason: str) -> None:
    env = (_fake_smi(tmp_path / "bin", smi) if smi is not None
           else {**os.environ, "PATH": "/usr/bin:/bin"})
    done = subprocess.run(["make", "-s", "test-gpu"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.stdout.splitlines()[0] == (
        f"test-gpu: SKIPPED (not passed): no GPU here ({reason}); nothing ran"), done.stdout
    assert "Error 77" in done.stderr  # make's exit: not 0, so no pipeline reads a pass
    assert done.returncode != 0


def test_the_discovery_script_hands_spark_the_gpus_nvidia_smi_lists(tmp_path: Path) -> None:
    env = _fake_smi(tmp_path / "bin", "printf '0\\n1\\n3\\n'")
    out = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, timeout=30,
                         check=True).stdout
    assert json.loads(out) == {"name": "gpu", "addresses": ["0", "1", "3"]}
    out = subprocess.run([str(SCRIPT)], env={**env, "SPARK_GPU_RESOURCE_NAME": "acc"},
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert json.loads(out)["name"] == "acc"
    failing = _fake_smi(tmp_path / "bin", "exit 9")
    done = subprocess.run([str(SCRIPT)], env=failing, capture_output=True, text=True,
                          timeout=30, check=False)
    assert done.returncode == 1 and "nvidia-smi failed on" in done.stderr


def test_the_gpu_tests_are_collected_by_their_tiers_alone() -> None:
    def collected(tier: str) -> set[str]:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             "tests/test_gpu.py", "tests/test_gpu_wheel.py"],
            cwd=REPO, env={**os.environ, "MLFLOW_HVD_TIER": tier}, capture_output=True,
            text=True, timeout=120, check=False)
        return {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}

    assert collected("gpu") == {"tests/test_gpu.py"}
    assert collected("new-end-gpu") == {"tests/test_gpu_wheel.py"}
    assert collected("main") == set()
