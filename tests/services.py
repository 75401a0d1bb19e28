"""Real services the tests start and stop: an MLflow server, a Spark standalone master and
its workers (the pip package has no sbin/ scripts: ``bin/spark-class`` starts each daemon).

Every wait polls a condition with a deadline; every process starts in its own session so
that its whole tree can be ended.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until(condition: Callable[[], Any], timeout: float, what: str,
               proc: subprocess.Popen[bytes] | None = None) -> Any:
    """Poll ``condition`` until it returns a truthy value; fail naming ``what`` after
    ``timeout`` seconds (or at once if ``proc`` exited)."""
    deadline = time.monotonic() + timeout
    interval = 0.01  # doubling up to 0.25 s: quick conditions are seen quickly
    while True:
        try:
            value = condition()
        except OSError:
            value = None
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        time.sleep(interval)
        interval = min(interval * 2, 0.25)


_SPARK_NOISE = ("TaskKilled", "Incomplete task interrupted", "Failed to cancel job group")


def stderr_tail(text: str, chars: int = 3000) -> str:
    """The end of a driver's stderr without what Spark prints while a job is cancelled (a
    line per killed task) and Java stack frames, so that a failure's cause is what shows."""
    kept = [line for line in text.splitlines()
            if not line.lstrip().startswith("at ") and not any(n in line for n in _SPARK_NOISE)]
    return "\n".join(kept)[-chars:]


def http_json(url: str) -> Any:
    """The JSON a URL answers; None while a starting server answers something else (Spark's
    web UI can answer an empty body before its pages are up)."""
    with urllib.request.urlopen(url, timeout=3) as r:
        body = r.read()
    try:
        return json.loads(body)
    except ValueError:
        return None


def http_ok(url: str, ca: Path | None = None) -> bool:
    import ssl

    context = ssl.create_default_context(cafile=str(ca)) if ca is not None else None
    with urllib.request.urlopen(url, timeout=3, context=context) as r:
        return bool(r.status == 200)


def stop_group(proc: subprocess.Popen[Any], grace: float = 10.0, gone_within: float = 30.0
               ) -> None:
    """SIGTERM the process's session, SIGKILL it after ``grace`` seconds, and return only once
    every process of the session is gone (a port it held is free again).

    Raises:
        TimeoutError: Something of the session survived ``gone_within`` seconds of SIGKILL.
    """
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait(timeout=gone_within)  # the leader: reaped here
    wait_until(lambda: not _group_alive(pgid), gone_within, f"the processes of session {pgid}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Program:
    """A subprocess in its own session whose stdout is read as it comes, by a thread, so that
    every wait on it has a deadline; ended with its whole session on every exit path (use it
    as a context manager)."""

    def __init__(self, cmd: Sequence[str], **popen: Any) -> None:
        self.proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, text=True,
                                     start_new_session=True, **popen)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def _next(self, deadline: float) -> str | None:
        """The next line; None at the end of output; TimeoutError past ``deadline``."""
        try:
            return self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError from None

    def wait_for_line(self, needle: str, timeout: float) -> str:
        """Read until a line containing ``needle``; fail after ``timeout`` seconds or at the end
        of the output, naming the last lines read."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._next(deadline)
            except TimeoutError:
                raise AssertionError(f"no line with {needle!r} within {timeout:g}s; last lines: "
                                     f"{self.lines[-20:]}") from None
            if line is None:
                raise AssertionError(f"the program ended (exit {self.proc.wait(10)}) without a "
                                     f"line with {needle!r}; last lines: {self.lines[-20:]}")
            self.lines.append(line)
            if needle in line:
                return line

    def finish(self, timeout: float) -> int:
        """Read the rest of the output and the exit status within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._next(deadline)
            except TimeoutError:
                raise AssertionError(f"the program did not end within {timeout:g}s; last "
                                     f"lines: {self.lines[-20:]}") from None
            if line is None:
                return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            self.lines.append(line)

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            stop_group(self.proc, grace=5)
        else:  # the leader is gone; its session's other processes must be too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def start(cmd: Sequence[str], log: Path,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


ADMIN_PASSWORD = "admin-pass-4-tests"  # of the basic-auth server's "admin" user


def auth_config(root: Path) -> dict[str, str]:
    """The environment of a ``--app-name basic-auth`` server: its user store in ``root``,
    the admin's password, the Flask secret key. Users have no permission by default."""
    ini = root / "basic_auth.ini"
    ini.write_text(
        "[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
        f"database_uri = sqlite:///{root}/basic_auth.db\nadmin_username = admin\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "grant_default_workspace_access = false\n"
        # a password check is a PBKDF2 hash: without the cache every request pays for one
        "auth_cache_ttl_seconds = 60\n")
    return {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-secret-key-" + root.name}


def self_signed(root: Path, host: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for ``host`` (an IP address) signed by it: (CA bundle,
    server certificate, server key), written into ``root``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mlflow_hvd test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                       crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False,
                                       decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    root.mkdir(parents=True, exist_ok=True)
    paths = (root / "ca.pem", root / "server.pem", root / "server.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def start_mlflow_server(host: str, root: Path, timeout: float = 90.0, port: int | None = None,
                        wait: bool = True, auth: bool = False, tls: bool = False
                        ) -> tuple[subprocess.Popen[bytes], str]:
    """``mlflow server`` with a SQLite backend and proxied artifacts (``mlflow-artifacts:/``
    locations: clients upload and download through the server, no shared disk).

    ``port``: reuse a port (a server restarted on the same store), default a free one.
    ``mlflow server`` takes a port number, not a bound socket, so a free port can be taken by
    someone else before the server binds it: with ``wait`` a server that exits because its
    port is in use is started again on another free port (three tries). ``wait=False``
    returns at once (start other services meanwhile), then call
    :func:`wait_for_mlflow_server`. ``auth``: MLflow's ``basic-auth`` app (:func:`auth_config`);
    ``tls``: HTTPS with a certificate of :func:`self_signed` (``root / "tls" / "ca.pem"`` is
    the CA bundle clients need)."""
    root.mkdir(parents=True, exist_ok=True)
    # without MLflow's job runner: it starts five more Python processes per server (each
    # importing MLflow) for GenAI jobs that no test uses
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           **(auth_config(root) if auth else {})}
    extra = ["--app-name", "basic-auth"] if auth else []
    if tls:
        _, cert, key = self_signed(root / "tls", host)
        extra += ["--uvicorn-opts", f"--ssl-certfile {cert} --ssl-keyfile {key}"]
    for attempt in range(3):
        chosen = port or free_port(host)
        log = root / "server.log"
        seen = log.stat().st_size if log.exists() else 0
        proc = start(
            [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(chosen),
             "--backend-store-uri", f"sqlite:///{root}/server.db",
             "--artifacts-destination", str(root / "artifacts"), "--serve-artifacts",
             "--allowed-hosts", f"{host}:{chosen},{host},localhost:{chosen},localhost",
             "--workers", "1", *extra],
            log, env=env,
        )
        url = f"{'https' if tls else 'http'}://{host}:{chosen}"
        if not wait:
            return proc, url
        try:
            wait_for_mlflow_server(proc, url, timeout, ca=root / "tls" / "ca.pem" if tls else None)
        except RuntimeError:
            clash = "address already in use" in log.read_text(errors="replace")[seen:].lower()
            if port is not None or not clash or attempt == 2:
                raise
            continue
        return proc, url
    raise AssertionError("unreachable: the loop returns or raises")


def wait_for_mlflow_server(proc: subprocess.Popen[bytes], url: str, timeout: float = 90.0,
                           ca: Path | None = None) -> None:
    """Until the server at ``url`` answers (verified against ``ca`` for HTTPS); on failure
    or timeout it is stopped."""
    try:
        wait_until(lambda: http_ok(f"{url}/health", ca), timeout, f"mlflow server at {url}",
                   proc)
    except BaseException:
        stop_group(proc)
        raise


class MlflowServer:
    """One ``mlflow server`` (see :func:`start_mlflow_server`) that tests may kill and bring
    back on the same port and store, as a server restarted after an outage would be."""

    def __init__(self, host: str, root: Path) -> None:
        self.host, self.root = host, root
        self.proc, self.url = start_mlflow_server(host, root)
        self.port = int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        """SIGKILL the server's whole process group (no graceful shutdown)."""
        stop_group(self.proc, grace=0)

    def is_up(self) -> bool:
        return self.proc.poll() is None and _healthy(self.url)

    def restart(self) -> None:
        """Start the server again on the same port and store (after it was killed)."""
        stop_group(self.proc, grace=0)
        self.proc, _ = start_mlflow_server(self.host, self.root, port=self.port)

    def stop(self) -> None:
        """At the session's end: SIGTERM, SIGKILL after 5 s (uvicorn's graceful shutdown
        took 13 s here; the SQLite store commits each request)."""
        stop_group(self.proc, grace=5)


def _healthy(url: str) -> bool:
    try:
        return http_ok(f"{url}/health")
    except OSError:
        return False


def spark_class() -> str:
    import pyspark

    return os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")


def start_spark_master(host: str, log_dir: Path, timeout: float = 60.0
                       ) -> tuple[subprocess.Popen[bytes], str, str]:
    """A standalone master bound to ``host``; returns (process, spark:// URL, web UI URL).

    The daemon takes port numbers, not bound sockets; a port taken meanwhile makes it exit
    (``spark.port.maxRetries=0``: it must not move to a port this function did not name),
    and it is started again on other free ports (three tries). The master's URL is read
    back from its own web UI."""
    env = {**os.environ, "SPARK_MASTER_OPTS": "-Dspark.port.maxRetries=0"}
    for attempt in range(3):
        port, ui = free_port(host), free_port(host)
        proc = start(
            [spark_class(), "org.apache.spark.deploy.master.Master", "--host", host,
             "--port", str(port), "--webui-port", str(ui)],
            log_dir / "master.log", env=env,
        )
        ui_url = f"http://{host}:{ui}"
        try:
            state = wait_until(functools.partial(http_json, f"{ui_url}/json/"), timeout,
                               "Spark master web UI", proc)
        except RuntimeError:  # it exited: a port was taken before it bound it
            stop_group(proc)
            if attempt == 2:
                raise
            continue
        except BaseException:
            stop_group(proc)
            raise
        return proc, str(state["url"]), ui_url
    raise AssertionError("unreachable: the loop returns or raises")


def alive_workers(ui_url: str) -> list[dict[str, Any]]:
    state = http_json(f"{ui_url}/json/") or {"workers": []}
    return [w for w in state["workers"] if w["state"] == "ALIVE"]


def applications(ui_url: str) -> list[dict[str, Any]]:
    state = http_json(f"{ui_url}/json/") or {}
    return list(state.get("activeapps", [])) + list(state.get("completedapps", []))


class ConnectServer:
    """A Spark Connect server from pyspark's own ``sbin/start-connect-server.sh`` (``--wait``:
    in the foreground, in its own session, so that stopping it ends its JVM and executors
    on every path), on ``master``; its executors run ``python``. ``url`` is the
    ``sc://`` address a client dials on ``host`` (the server listens on every address),
    ``ui_url`` the application's web UI (its REST API says which jobs run). The script
    takes port numbers, not bound sockets: a port taken meanwhile makes it exit
    (``spark.port.maxRetries=0``), and it is started again on other free ports (three
    tries)."""

    def __init__(self, master: str, log_dir: Path, python: str = sys.executable,
                 timeout: float = 120.0, conf: dict[str, str] | None = None,
                 host: str = "127.0.0.1") -> None:
        import pyspark

        home = os.path.dirname(pyspark.__file__)
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "SPARK_HOME": home, "PYSPARK_PYTHON": python,
               "SPARK_PID_DIR": str(log_dir), "SPARK_LOG_DIR": str(log_dir),
               "SPARK_IDENT_STRING": f"mlflow-hvd-tests-{os.getpid()}"}
        env.pop("PYSPARK_SUBMIT_ARGS", None)
        # its scratch space (archives uploaded to it among others, gigabytes) under the
        # test's directory, removed by stop(): a server killed before Spark's shutdown hook
        # ran would leave it in /tmp
        self.local_dir = log_dir / "spark-local"
        self.local_dir.mkdir(exist_ok=True)
        settings = {"spark.port.maxRetries": "0", "spark.ui.showConsoleProgress": "false",
                    "spark.local.dir": str(self.local_dir), **(conf or {})}
        for attempt in range(3):
            port, ui = free_port(), free_port()
            confs = {**settings, "spark.connect.grpc.binding.port": str(port),
                     "spark.ui.port": str(ui)}
            log = log_dir / f"connect-server-{attempt}.log"
            self.proc = start(
                [os.path.join(home, "sbin", "start-connect-server.sh"), "--wait",
                 "--master", master,
                 *[arg for key, value in confs.items() for arg in ("--conf", f"{key}={value}")]],
                log, env=env)
            self.url, self.ui_url = f"sc://{host}:{port}", f"http://{host}:{ui}"
            self.port, self.log = port, log
            try:
                wait_until(functools.partial(self._listening, host, port), timeout,
                           "the Spark Connect server", self.proc)
            except RuntimeError:  # it exited: a port was taken before it bound it
                stop_group(self.proc)
                if attempt == 2:
                    raise
                continue
            except BaseException:
                stop_group(self.proc)
                raise
            return

    @staticmethod
    def _listening(host: str, port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex((host, port)) == 0

    def running_jobs(self) -> list[dict[str, Any]]:
        """The server application's running Spark jobs (its REST API)."""
        (app,) = http_json(f"{self.ui_url}/api/v1/applications") or [None]
        if app is None:
            return []
        return list(http_json(f"{self.ui_url}/api/v1/applications/{app['id']}/jobs"
                              "?status=running") or [])

    def stop(self) -> None:
        try:
            stop_group(self.proc, grace=10)
        finally:
            shutil.rmtree(self.local_dir, ignore_errors=True)
