"""Every raise of the small pure modules, each with its whole message (no processes)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import mlflow_hvd
from mlflow_hvd.cli.common import load_function, whole_number
from mlflow_hvd.common.options import check_np, check_positive_int, check_seconds
from mlflow_hvd.driver.channel_server import ChannelServer
from mlflow_hvd.errors import AuthenticationError, ChannelError, ConfigurationError
from mlflow_hvd.protocol.channel import (
    MAGIC,
    ChannelClient,
    encode_frame,
    read_frame,
)
from mlflow_hvd.protocol.messages import RankDisconnected, WorkerStarted
from mlflow_hvd.sweep.space import validate_space

SECRET = b"s" * 32


def test_unknown_top_level_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="^module 'mlflow_hvd' has no attribute 'Nope'$"):
        _ = mlflow_hvd.Nope  # type: ignore[attr-defined]
    assert mlflow_hvd.HorovodRunner.__name__ == "HorovodRunner"
    assert "HorovodRunner" in dir(mlflow_hvd)


def test_option_validators_name_the_option() -> None:
    assert check_np(-2) == -2
    with pytest.raises(ConfigurationError) as info:
        check_np(True)
    assert str(info.value) == (
        "np must be a non-zero integer, got True (bool): use np=-N for N processes on the "
        "driver, np=N for N Spark barrier tasks"
    )
    assert check_seconds("t", 2) == 2.0
    with pytest.raises(ConfigurationError) as info:
        check_seconds("start_timeout", -1)
    assert str(info.value) == "start_timeout must be a positive number of seconds, got -1"
    assert check_positive_int("n", 3) == 3
    with pytest.raises(ConfigurationError) as info:
        check_positive_int("max_evals", 1.5)
    assert str(info.value) == "max_evals must be an integer >= 1, got 1.5"


def test_whole_number_arguments() -> None:
    assert whole_number("2.0") == 2
    with pytest.raises(argparse.ArgumentTypeError, match="^'two' is not a number$"):
        whole_number("two")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'2.5' is not a whole number$"):
        whole_number("2.5")


def test_load_function_from_a_file_and_a_module(tmp_path: Path) -> None:
    script = tmp_path / "my_training_prog.py"
    script.write_text("def train(**kw):\n    return 'trained'\n")
    assert load_function(f"{script}:train")() == "trained"
    assert load_function("os.path:join")("a", "b") == "a/b"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("train", "--train 'train': expected 'path/to/file.py:function' or 'module:function'"),
        ("/no/such.py:train", "--train '/no/such.py:train': no such file /no/such.py"),
        ("no_such_pkg_xyz:train",
         "--train 'no_such_pkg_xyz:train': cannot import no_such_pkg_xyz: No module named "
         "'no_such_pkg_xyz'"),
        ("os.path:nothing_here", "--train 'os.path:nothing_here': os.path has no function "
         "'nothing_here'"),
    ],
)
def test_load_function_refuses_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        load_function(spec)
    assert str(info.value) == message


def test_space_keys_must_be_names() -> None:
    from hyperopt import hp

    with pytest.raises(ConfigurationError) as info:
        validate_space({"": hp.uniform("x", 0, 1)})
    assert str(info.value) == "space keys must be non-empty strings, got ''"


def test_search_space_entry_with_bad_arguments() -> None:
    from mlflow_hvd.sweep import space_from_json

    with pytest.raises(ConfigurationError) as info:
        space_from_json({"x": ["choice", 5]})
    assert str(info.value) == "search space entry 'x': object of type 'int' has no len()"


class _Pair:
    """A connected socket pair: ``a`` writes raw bytes, ``b`` is read by read_frame."""

    def __init__(self) -> None:
        self.a, self.b = socket.socketpair()
        self.b.settimeout(5)

    def close(self) -> None:
        self.a.close()
        self.b.close()


def test_frame_cut_short_is_an_eof_naming_the_missing_bytes() -> None:
    pair = _Pair()
    frame = encode_frame(SECRET, WorkerStarted(0, "h"))
    pair.a.sendall(frame[:-5])
    pair.a.close()
    with pytest.raises(EOFError, match=r"^connection closed with 5 of \d+ bytes unread$"):
        read_frame(pair.b, SECRET)
    pair.close()


def test_connection_closed_between_frames_is_a_plain_eof() -> None:
    pair = _Pair()
    pair.a.close()
    with pytest.raises(EOFError, match="^connection closed$"):
        read_frame(pair.b, SECRET)
    pair.close()


def test_oversize_frame_is_refused_from_its_header() -> None:
    pair = _Pair()
    pair.a.sendall(MAGIC + (1 << 40).to_bytes(8, "big"))
    with pytest.raises(AuthenticationError) as info:
        read_frame(pair.b, SECRET, max_frame=1024)
    assert str(info.value) == f"frame of {1 << 40} bytes exceeds the limit of 1024"
    pair.close()


def test_send_to_a_driver_that_is_gone_is_a_channel_error() -> None:
    received: list[Any] = []
    server = ChannelServer(SECRET, received.append, bind_host="127.0.0.1")
    port = server.start()
    client = ChannelClient("127.0.0.1", port, SECRET, timeout=5)
    client.send(WorkerStarted(0, "h"))
    # the peer resets the connection: the next send fails with a clear error
    client._sock.shutdown(socket.SHUT_RDWR)
    with pytest.raises(ChannelError) as info:
        client.send(WorkerStarted(0, "h"))
    assert str(info.value).startswith(
        f"lost the connection to the driver at 127.0.0.1:{port} while sending WorkerStarted: "
    )
    client.close()
    server.stop()
    assert received == [WorkerStarted(0, "h"), RankDisconnected(0)]


def test_no_interface_holding_the_route_source_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import psutil

    from mlflow_hvd.agent.spark_task import iface_towards

    assert iface_towards("127.0.0.1") == "lo"
    own = [
        (name, a.address)
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    assert own, "this machine has no non-loopback IPv4 address"
    name, address = own[0]
    assert iface_towards(address) == name  # a route to ourselves: its own interface
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {})  # the address vanished
    with pytest.raises(ConfigurationError) as info:
        iface_towards(address)
    assert str(info.value) == (
        f"no network interface holds {address}, the address that routes to the driver at "
        f"{address}; pass HorovodRunner(gloo_iface=...) with the interface Gloo should use"
    )




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


def test_worker_lines_carry_the_log_prefix() -> None:
    import io

    from mlflow_hvd.driver.supervisor import DriverSettings, JobRecord, Verbosity, handle
    from mlflow_hvd.protocol.messages import OutputLines, Stream

    out = io.StringIO()
    settings = DriverSettings(verbosity=Verbosity.ALL, log_prefix="[trial 3]")
    handle(OutputLines(1, Stream.STDOUT, ("hello",)), JobRecord(2), settings, out)
    assert out.getvalue() == "[trial 3][1]<stdout>: hello\n"


def test_an_entry_point_exits_at_once_with_its_output_flushed() -> None:
    """``exit_now``: the status, buffered output flushed, ``atexit`` hooks skipped (as
    documented)."""
    import subprocess
    import sys

    code = (
        "import atexit, sys\n"
        "from mlflow_hvd.cli.common import exit_now\n"
        "atexit.register(lambda: print('atexit ran'))\n"
        "print('buffered line', end='')\n"  # stdout is a pipe: block-buffered
        "sys.stderr.write('an error line')\n"
        "exit_now(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "buffered line", "an error line")


def test_the_keras_guard_reads_package_metadata_only_when_a_refused_layer_is_imported() -> None:
    """Installing it is on every rank's way to ``main``: reading metadata there cost
    0.2-0.3 s in Spark tasks. The refusal itself is tested end to end in test_keras_dropin."""
    script = textwrap.dedent("""
        import importlib.metadata, sys
        calls = []
        real = importlib.metadata.version
        importlib.metadata.version = lambda name: calls.append(name) or real(name)
        from mlflow_hvd.errors import IncompatibleImportError
        from mlflow_hvd.rank import keras_guard
        assert keras_guard.install() and not keras_guard.install()
        import json  # any other import passes the guard untouched
        assert calls == [], calls
        try:
            import horovod.keras
        except IncompatibleImportError as exc:
            print(json.dumps([calls, str(exc)]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    calls, message = json.loads(out.stdout)
    assert calls == ["keras"]  # once, at the refused import
    assert message.startswith("horovod.keras does not work with Keras 3.")
    assert message.endswith("Replace `import horovod.tensorflow.keras as hvd` with "
                            "`import mlflow_hvd.keras as hvd`: the same names, on Keras 3 "
                            "(README: Migrating)")
