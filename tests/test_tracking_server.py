"""Rank 0's checks of the tracking server and the artifact store (common/tracking_server.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest


def test_rank_0_refuses_a_tracking_server_it_cannot_reach() -> None:
    from mlflow_hvd.common.tracking_server import check_server_reachable
    from mlflow_hvd.errors import TrackingError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TrackingError) as info:
        check_server_reachable(f"http://127.0.0.1:{port}", "rank 0 on host node-a", timeout=1.0)
    assert str(info.value).startswith(
        f"rank 0 on host node-a cannot reach the MLflow tracking server http://127.0.0.1:{port} "
        "within 1s: "
    )
    assert str(info.value).endswith(
        "Executors must reach MLFLOW_TRACKING_URI: use an address of the server that every "
        "node can connect to (not localhost), and open its port"
    )
    check_server_reachable("sqlite:///x.db", "node-a")  # not a server: nothing to check


@pytest.mark.parametrize(
    ("uri", "local"),
    [("{tmp}/mlruns/0/r/artifacts", True), ("file://{tmp}/mlruns/0/r/artifacts", True),
     ("mlflow-artifacts:/0/r/artifacts", False), ("s3://bucket/0/r/artifacts", False),
     ("mlruns/0/r/artifacts", False)],
)
def test_the_driver_creates_a_local_artifact_directory_only(
    tmp_path: Path, uri: str, local: bool
) -> None:
    from mlflow_hvd.common.tracking_server import make_local_artifact_dir

    path = str(tmp_path / "mlruns" / "0" / "r" / "artifacts")
    assert make_local_artifact_dir(uri.format(tmp=tmp_path)) == (path if local else "")
    assert os.path.isdir(path) == local


def test_rank_0_refuses_files_for_a_local_artifact_directory_it_cannot_see(
    tmp_path: Path,
) -> None:
    from mlflow_hvd.common.tracking_server import check_local_artifacts
    from mlflow_hvd.errors import TrackingError

    check_local_artifacts(str(tmp_path), "rank 0 on host node-a")  # seen: fine
    check_local_artifacts("", "rank 0 on host node-a")  # not a local store: nothing to check
    missing = str(tmp_path / "elsewhere")
    with pytest.raises(TrackingError) as info:
        check_local_artifacts(missing, "rank 0 on host node-a")
    assert str(info.value) == (
        f"rank 0 on host node-a cannot see the run's artifact directory {missing}, which is on "
        "the driver's disk: artifacts (checkpoints, the model) would be written to this host's "
        "own disk and lost. Track to an MLflow server with proxied artifacts (mlflow server "
        "--serve-artifacts; MLFLOW_TRACKING_URI=http://...), or keep the store on a disk every "
        "node mounts at the same path"
    )
    assert not os.path.exists(missing)
