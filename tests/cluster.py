"""A two-node Spark standalone cluster on this machine, for the cluster tests.

Each worker runs in its own Linux network, UTS and mount namespace: its own hostname
(``node-a``, ``node-b``), its own address on a veth pair to a bridge, its own ``/tmp``
(a tmpfs: no view of the driver's working directory or temp files). The master, the
MLflow server (proxied artifacts) and the driver stay in the host namespace, on the
bridge's address. Addresses come from an RFC 5737 documentation range that no route of
this machine uses; IP forwarding is left as it is (off), so nothing leaves the machine.

Needs root (CI runs as root). ``MLFLOW_HVD_NO_NAMESPACES=1`` skips the cluster tests on
machines that cannot create namespaces; CI never sets it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services import (
    alive_workers,
    spark_class,
    start,
    start_mlflow_server,
    start_spark_master,
    stderr_tail,
    stop_group,
    wait_for_mlflow_server,
    wait_until,
)

PREFIX = "mhvd"
BRIDGE = f"{PREFIX}-br"
# Each node's interface carries the bridge's name: tools that match interfaces by name
# across driver and tasks (horovod.spark.run's NIC discovery) then find one that routes.
NODE_IFACE = BRIDGE
NODES = ("node-a", "node-b")
CANDIDATES = ("198.51.100.0/24", "203.0.113.0/24")
STATE = Path("/var/tmp/mlflow-hvd-testcluster")  # outside every node's private /tmp
OPT_OUT = "MLFLOW_HVD_NO_NAMESPACES"
TESTS = Path(__file__).resolve().parent


class ClusterUnavailable(RuntimeError):
    """The machine cannot host the test cluster (not root, no namespaces, no free range)."""


@dataclass
class Cluster:
    """A running test cluster. ``conf_dir`` holds a spark-defaults.conf naming its master."""

    subnet: str
    driver_ip: str
    node_ips: dict[str, str]
    master_url: str
    master_ui: str
    mlflow_url: str
    artifact_root: Path
    conf_dir: Path
    state: Path
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    bare: bool = False  # nodes without the driver's environment and checkout

    def namespace(self, node: str) -> str:
        return f"{PREFIX}-{node}"

    def driver_env(self, **extra: str) -> dict[str, str]:
        """Environment of a driver process that should use this cluster and tracking server."""
        env = dict(os.environ)
        env.update(
            SPARK_CONF_DIR=str(self.conf_dir),
            MLFLOW_TRACKING_URI=self.mlflow_url,
            PYSPARK_PYTHON=sys.executable,
            PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        )
        env.update(extra)
        return env

    def run_in(self, node: str, *cmd: str) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` inside ``node``'s network and mount namespaces (its private /tmp)."""
        pid = str(self.workers[node].pid)
        return subprocess.run(["nsenter", "-t", pid, "-n", "-m", "-u", *cmd],
                              capture_output=True, text=True, timeout=60)

    def pids(self, node: str) -> list[int]:
        """Pids of every process inside ``node`` (by its network namespace)."""
        out = _ip("netns", "pids", self.namespace(node), check=False).stdout
        return sorted(int(p) for p in out.split())

    def rank_pids(self, node: str) -> list[int]:
        """Pids of mlflow_hvd rank processes inside ``node`` (by its network namespace: a
        plain pgrep would see every node's processes, PIDs are not namespaced here)."""
        import psutil

        found = []
        for pid in _ip("netns", "pids", self.namespace(node), check=False).stdout.split():
            with contextlib.suppress(psutil.Error, ValueError):
                if "mlflow_hvd.rank.worker" in psutil.Process(int(pid)).cmdline():
                    found.append(int(pid))
        return sorted(found)

    def kill_node(self, node: str) -> None:
        """A lost machine: every process in the node's namespace gets SIGKILL."""
        _kill_namespace(self.namespace(node))

    def executor_logs(self, node: str) -> set[Path]:
        """The stderr files of every executor ``node``'s worker started (its work dir)."""
        return set((self.state / node / "work").glob("app-*/*/stderr"))

    def wait_for_new_executor(self, node: str, before: set[Path], timeout: float) -> None:
        """Wait until an executor of ``node`` not among ``before`` (:meth:`executor_logs`)
        registered with its driver (from then on the driver counts its slots)."""
        wait_until(lambda: any("Successfully registered with driver" in p.read_text(
            errors="replace") for p in self.executor_logs(node) - before), timeout,
            f"a new executor on {node} registered with the driver")

    def use_nodes(self, bare: bool) -> None:
        """Restart both workers as bare nodes (:func:`hidden_on_bare_nodes`) or as nodes
        with the driver's environment, unless they already are; the network, the master and
        the tracking server stay. The executors' work dirs go with the old workers."""
        if bare == self.bare:
            return
        for node in NODES:
            self.kill_node(node)
        wait_until(lambda: not alive_workers(self.master_ui), 90,
                   "the master to see both workers gone")
        _discard_work_dirs()
        self.bare = bare
        for node in NODES:
            self.workers[node] = _start_worker(node, self.node_ips[node], self.master_url,
                                               self.state / "hosts", self.state, bare)
        wait_until(lambda: len(alive_workers(self.master_ui)) == len(NODES), 90,
                   f"both {'bare ' if bare else ''}workers registered with the master")

    def restart_node(self, node: str) -> None:
        """Bring a killed node's worker back and wait until the master counts it alive."""
        self.workers[node] = _start_worker(node, self.node_ips[node], self.master_url,
                                           self.state / "hosts", self.state, self.bare)
        wait_until(lambda: len(alive_workers(self.master_ui)) == len(NODES), 90,
                   f"the worker on {node} registered again")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def choose_subnet() -> ipaddress.IPv4Network:
    """The first documentation range that overlaps no route or address of this machine."""
    used = []
    lines = _ip("-4", "route").stdout.splitlines() + _ip("-4", "-o", "addr").stdout.splitlines()
    for token in " ".join(lines).split():
        if token[:1].isdigit():
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(token, strict=False))
    for candidate in map(ipaddress.ip_network, CANDIDATES):
        if not any(candidate.overlaps(u) for u in used if u.prefixlen > 0):
            return candidate  # type: ignore[return-value]
    raise ClusterUnavailable(
        f"every documentation range {CANDIDATES} overlaps a network of this machine "
        f"({', '.join(map(str, used))}); refusing to start the test cluster"
    )


def _kill_namespace(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(Exception):
        wait_until(lambda: not _ip("netns", "pids", ns, check=False).stdout.split(), 15,
                   f"processes of namespace {ns} to die")


def teardown_leftovers() -> None:
    """Remove what a killed earlier run left: namespaces, bridge, daemons it recorded."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(f"{PREFIX}-"):
            _kill_namespace(ns)
            _ip("netns", "del", ns, check=False)
    _ip("link", "del", BRIDGE, check=False)
    # a veth's host end outlives its deleted namespace while anything still holds that
    # namespace (the kernel frees it later); its name would block the next run's set-up
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(": ")[1].split("@")[0] if ": " in line else ""
        if name.startswith(f"{PREFIX}-v"):
            _ip("link", "del", name, check=False)
    for proc in _leftover_daemons():
        with contextlib.suppress(Exception):
            proc.kill()


def _leftover_daemons() -> list[Any]:
    """This cluster's master and MLflow server from an earlier, killed run: recognised by
    their command lines (the state directory, or a master bound in a test range), never
    by a recorded pid that may have been reused."""
    import psutil

    found = []
    ranges = [ipaddress.ip_network(c) for c in CANDIDATES]
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        text = " ".join(cmd)
        if str(STATE) in text and "mlflow" in text:
            found.append(proc)
        elif "org.apache.spark.deploy.master.Master" in cmd and "--host" in cmd:
            host = cmd[cmd.index("--host") + 1] if cmd.index("--host") + 1 < len(cmd) else ""
            with contextlib.suppress(ValueError):
                if any(ipaddress.ip_address(host) in r for r in ranges):
                    found.append(proc)
    return found


def _network(subnet: ipaddress.IPv4Network) -> tuple[str, dict[str, str]]:
    hosts = list(subnet.hosts())
    driver_ip = str(hosts[0])
    node_ips = {node: str(hosts[10 + i]) for i, node in enumerate(NODES)}
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{driver_ip}/{subnet.prefixlen}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for i, node in enumerate(NODES):
        ns, host_end, node_end = f"{PREFIX}-{node}", f"{PREFIX}-v{i}", f"{PREFIX}-p{i}"
        _ip("netns", "add", ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", node_end)
        _ip("link", "set", node_end, "netns", ns)
        _ip("link", "set", host_end, "master", BRIDGE, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "set", node_end, "name", NODE_IFACE)
        _ip("-n", ns, "addr", "add", f"{node_ips[node]}/{subnet.prefixlen}", "dev", NODE_IFACE)
        _ip("-n", ns, "link", "set", NODE_IFACE, "up")
    return driver_ip, node_ips


def kept_under_tmp() -> list[Path]:
    """What must stay visible inside a node whose /tmp is private: the project and the
    Python environment (the "same image" on every node), when they live under /tmp."""
    paths = {Path(__file__).resolve().parents[1], Path(sys.prefix).resolve()}
    return sorted(p for p in paths if p.is_relative_to("/tmp"))


def hidden_on_bare_nodes() -> list[Path]:
    """What a bare node must not see: the checkout, the driver's venv, the environments
    ``mlflow run`` creates and this project's caches (packed archives, Horovod wheels);
    covered by empty tmpfs mounts in the node's mount namespace. Nested paths are covered
    by their outermost one."""
    home = Path.home()
    candidates = {Path(__file__).resolve().parents[1], Path(sys.prefix).resolve(),
                  Path(os.environ.get("MLFLOW_ENV_ROOT") or home / ".mlflow" / "envs"),
                  Path(os.environ.get("MLFLOW_HVD_CACHE") or home / ".cache" / "mlflow_hvd")}
    for made_later in candidates - {Path(__file__).resolve().parents[1], Path(sys.prefix)}:
        made_later.mkdir(parents=True, exist_ok=True)  # covered before anything is in it
    existing = sorted(p for p in candidates if p.is_dir() and not p.is_relative_to("/tmp"))
    return [p for p in existing if not any(p != q and p.is_relative_to(q) for q in existing)]


# The GPUs each node's worker offers, found by Spark's discovery script (no real GPU: Spark
# only schedules addresses). Applications that request none are unaffected.
GPUS = {"node-a": ("3", "7"), "node-b": ("0", "5")}


def _start_worker(node: str, ip: str, master_url: str, hosts_file: Path,
                  state: Path, bare: bool = False) -> subprocess.Popen[bytes]:
    work = state / node / "work"
    work.mkdir(parents=True, exist_ok=True)
    # executors' scratch (fetched archives: a shipped environment is 1-3 GiB) on the disk,
    # as on a real node, not in the node's small /tmp: Spark's local dirs, and the JVMs'
    # java.io.tmpdir (an executor copies each fetched archive into a temp dir of its own
    # before unpacking it); discarded with the work dir
    local = work / "local"
    local.mkdir(exist_ok=True)
    discover = state / node / "discover-gpus.sh"
    addresses = ", ".join(f'"{a}"' for a in GPUS[node])
    discover.write_text(f"#!/bin/sh\necho '{{\"name\": \"gpu\", \"addresses\": [{addresses}]}}'\n")
    discover.chmod(0o755)
    gpu_opts = (f"-Dspark.worker.resource.gpu.amount={len(GPUS[node])} "
                f"-Dspark.worker.resource.gpu.discoveryScript={discover}")
    # Inside the node's own mount namespace only: the kept paths are bound onto a fresh
    # tmpfs first, /tmp is replaced by an empty tmpfs, and the kept paths are bound back.
    # Nothing of the host's /tmp is ever mounted under a host-visible directory.
    stage = f"/run/{PREFIX}-{node}-keep"
    kept = [] if bare else kept_under_tmp()
    keep_in = "".join(
        f"mkdir -p {stage}/{i} && mount --bind {p} {stage}/{i} && "
        for i, p in enumerate(kept)
    )
    keep_out = "".join(
        f"mkdir -p {p} && mount --bind {stage}/{i} {p} && "
        for i, p in enumerate(kept)
    )
    # the session's own JVM options (tests/conftest.py) after the node's temporary directory
    java_options = " ".join(
        filter(None, [f"-Djava.io.tmpdir={local}", os.environ.get("JAVA_TOOL_OPTIONS")]))
    spark_home = Path(spark_class()).parents[1]
    if bare:
        # Spark (the pip package's directory) stays reachable through a bind made before
        # the venv holding it is covered: a node with Java and Spark, not the environment
        keep_in += (f"mkdir -p {stage}/spark && mount --bind {spark_home} {stage}/spark && "
                    + "".join(f"mount -t tmpfs -o size=1m tmpfs {p} && "
                              for p in hidden_on_bare_nodes()))
        spark_home = Path(stage, "spark")
    script = (
        f"hostname {node} && mount --bind {hosts_file} /etc/hosts && "
        f"mkdir -p {stage} && mount -t tmpfs -o size=1m tmpfs {stage} && {keep_in}"
        f"mount -t tmpfs -o size=2g tmpfs /tmp && {keep_out}"
        f"export SPARK_WORKER_OPTS='{gpu_opts}' SPARK_HOME={spark_home} "
        f"SPARK_LOCAL_DIRS={local} JAVA_TOOL_OPTIONS={shlex.quote(java_options)} && "
        f"exec {spark_home}/bin/spark-class org.apache.spark.deploy.worker.Worker {master_url} "
        f"--host {ip} --cores 2 --memory 3g --work-dir {work}"
    )
    cmd = ["ip", "netns", "exec", f"{PREFIX}-{node}", "unshare", "--uts", "--mount",
           "--propagation", "private", "sh", "-c", script]
    return start(cmd, state / f"{node}.log")


def _remove_state() -> None:
    """Empty the state directory without ever descending into a mount point."""
    def remove(path: Path) -> None:
        if os.path.ismount(path):
            raise ClusterUnavailable(f"{path} is a mount point: unmount it before a new run")
        if path.is_dir() and not path.is_symlink():
            for child in path.iterdir():
                remove(child)
            path.rmdir()
        else:
            path.unlink()

    if STATE.exists():
        for child in STATE.iterdir():
            remove(child)


@contextlib.contextmanager
def two_node_cluster(bare: bool = False) -> Iterator[Cluster]:
    """Start the cluster; tear all of it down on every exit path. ``bare`` nodes have Java,
    Spark and the base Python, but neither the driver's environment nor the checkout
    (:func:`hidden_on_bare_nodes`)."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("the test cluster needs root (Linux namespaces)")
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        raise ClusterUnavailable("the test cluster needs 'ip' (iproute2) and 'unshare'")
    STATE.mkdir(parents=True, exist_ok=True)
    teardown_leftovers()
    _remove_state()
    subnet = choose_subnet()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        driver_ip, node_ips = _network(subnet)
        hosts = STATE / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + f"{driver_ip} driver\n"
                         + "".join(f"{ip} {node}\n" for node, ip in node_ips.items()))
        # the server (Python) starts while the JVMs do: about 10 s of fixture set-up less
        server, mlflow_url = start_mlflow_server(driver_ip, STATE / "mlflow", wait=False)
        procs.append(server)
        master, master_url, master_ui = start_spark_master(driver_ip, STATE)
        procs.append(master)
        workers = {}
        for node, ip in node_ips.items():
            workers[node] = _start_worker(node, ip, master_url, hosts, STATE, bare)
            procs.append(workers[node])
        wait_until(lambda: len(alive_workers(master_ui)) == len(NODES), 90,
                   "both Spark workers registered with the master")
        wait_for_mlflow_server(server, mlflow_url)
        conf = STATE / "conf"
        conf.mkdir(exist_ok=True)
        (conf / "spark-defaults.conf").write_text(
            f"spark.master {master_url}\n"
            f"spark.driver.host {driver_ip}\n"
            f"spark.driver.bindAddress {driver_ip}\n"
            "spark.ui.enabled false\n"
            "spark.executor.memory 1g\n"
            "spark.executor.cores 2\n"
            "spark.executorEnv.TF_CPP_MIN_LOG_LEVEL 2\n"
        )
        yield Cluster(str(subnet), driver_ip, node_ips, master_url, master_ui, mlflow_url,
                      STATE / "mlflow" / "artifacts", conf, STATE, workers, bare)
    finally:
        for node in NODES:
            _kill_namespace(f"{PREFIX}-{node}")
        for proc in procs:
            stop_group(proc, grace=5)
        teardown_leftovers()
        _discard_work_dirs()


def _discard_work_dirs() -> None:
    """The executors' work dirs hold shipped environments (gigabytes each; removing them
    took 2 minutes of a 2-core CI): moved aside at once and removed by a background
    ``rm`` while the next tests run."""
    trash = STATE.parent / f"{STATE.name}-trash-{os.getpid()}-{time.time_ns()}"
    moved = False
    for node in NODES:
        work = STATE / node / "work"
        if work.is_dir():
            trash.mkdir(exist_ok=True)
            work.rename(trash / node)
            moved = True
    # with any left by a run killed before its rm finished
    stale = [str(t) for t in STATE.parent.glob(f"{STATE.name}-trash-*") if t != trash]
    if moved or stale:
        subprocess.Popen(["rm", "-rf", *([str(trash)] if moved else []), *stale],
                         start_new_session=True, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)


def drive(cluster: Cluster, body: str, cwd: Path, timeout: float = 300, **env: str) -> Any:
    """Run a driver program; returns what it printed after ``RESULT`` (JSON), or the
    error it raised as ``{"error": type, "message": ..., "elapsed": ...}``: seconds from
    ``t0 = time.monotonic()`` in the body to the error (None if the body set no ``t0``)."""
    script = "\n".join([
        "import json, sys, time",
        f"sys.path.insert(0, {str(TESTS)!r})",
        "import workers",
        "from mlflow_hvd import ClusterConfig, HorovodRunner, JobConfig, TrackingConfig",
        "t0 = None  # a body sets it where the wait it tests starts",
        "try:",
        textwrap.indent(textwrap.dedent(body).strip("\n"), "    "),
        "except Exception as exc:",
        "    print('RESULT ' + json.dumps({'error': type(exc).__name__, 'message': str(exc),",
        "        'elapsed': None if t0 is None else time.monotonic() - t0}))",
        "else:",
        "    print('RESULT ' + json.dumps(result))",
    ])
    proc = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=cluster.driver_env(**env),
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"driver printed no result (exit {proc.returncode}):\n{stderr_tail(proc.stderr)}"
    return json.loads(lines[-1][len("RESULT "):])


@contextlib.contextmanager
def cluster_for_tests(bare: bool = False) -> Iterator[Cluster]:
    """The cluster a test module runs on: :func:`two_node_cluster`, where the opt-out
    skips it outside CI only and a cluster that cannot start fails the tests."""
    import pytest

    if os.environ.get(OPT_OUT) == "1":
        if os.environ.get("CI"):
            pytest.fail(f"{OPT_OUT}=1 is for local runs only: CI runs the cluster tests")
        pytest.skip(f"{OPT_OUT}=1: this machine opted out of the namespace cluster tests")
    try:
        with two_node_cluster(bare) as c:
            yield c
    except ClusterUnavailable as exc:
        pytest.fail(f"cannot start the two-node test cluster: {exc} (set {OPT_OUT}=1 only on "
                    "machines that cannot create namespaces; CI must not)")


@contextlib.contextmanager
def tracking_client(cluster: Cluster) -> Iterator[Any]:
    """An MLflow client of the cluster's tracking server (this process's URI restored)."""
    import mlflow

    old = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(cluster.mlflow_url)
    try:
        yield mlflow.MlflowClient()
    finally:
        mlflow.set_tracking_uri(old)


@contextlib.contextmanager
def laptop_host() -> Iterator[tuple[str, str]]:
    """A third host beside the running cluster, as a laptop is: its own network namespace
    (``mhvd-laptop``), linked by a veth pair to the driver's host only, on a /30 of the next
    documentation range no route uses. The driver's host reaches it; the nodes have no
    route to it. Yields (the driver host's address on that link, the laptop's); the
    namespace and the link are removed on every path (:func:`teardown_leftovers` too)."""
    link = next(choose_subnet().subnets(new_prefix=30))
    host_ip, laptop_ip = (str(h) for h in link.hosts())
    ns, host_end, laptop_end = f"{PREFIX}-laptop", f"{PREFIX}-vl", f"{PREFIX}-pl"
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", laptop_end)
        _ip("link", "set", laptop_end, "netns", ns)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_end)
        _ip("link", "set", host_end, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{laptop_ip}/30", "dev", laptop_end)
        _ip("-n", ns, "link", "set", laptop_end, "up")
        yield host_ip, laptop_ip
    finally:
        _kill_namespace(ns)
        _ip("netns", "del", ns, check=False)
        _ip("link", "del", host_end, check=False)
