"""Local process stack: Kafka (KRaft), Redis, Jaeger v2 and gpusched services as plain processes.

Backs `gpusched up/down/status` and the integration-test fixtures; all state lives under run_dir.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil

__all__ = [
    "INFRA_COMPONENTS",
    "LocalStack",
    "ProcessStatus",
    "ServiceSpec",
    "StackEndpoints",
    "StackError",
    "StackPorts",
    "default_cache_dir",
    "find_repo_root",
    "http_ready",
    "jaeger_env",
    "kafka_ready",
    "redis_ready",
    "stop_timeout_s",
]

# Start order of the infrastructure; stop order is the reverse.
INFRA_COMPONENTS: tuple[str, ...] = ("kafka", "redis", "jaeger")

# Lean JVM for a single-node dev broker: the heap is capped at 512 MiB and the off-heap pools
# are bounded too, so the broker's RSS stays well under 1 GiB. The JIT is the JVM's default
# (C1, then C2 for hot code): C2 costs CPU for a minute or two after a start, but then the
# broker needs about a quarter less of it (scheduler bench, 2 cores, after a minute's
# warm-up: 35-36% of a core at 500 requests/s against 46-49% with C1 only), which a
# long-running broker repays many times over.
KAFKA_JVM_FLAGS: tuple[str, ...] = (
    "-Xms256m",
    "-Xmx512m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:MaxMetaspaceSize=192m",
    "-XX:ReservedCodeCacheSize=96m",
    "-XX:MaxDirectMemorySize=256m",
    "-Xss512k",
    "-XX:+ExitOnOutOfMemoryError",
    "-XX:-UsePerfData",
    "-Djava.awt.headless=true",
)
KAFKA_BROKER_SETTINGS: dict[str, str] = {
    "process.roles": "broker,controller",
    "node.id": "1",
    "controller.listener.names": "CONTROLLER",
    "inter.broker.listener.name": "PLAINTEXT",
    "num.partitions": "3",
    "num.network.threads": "2",
    "num.io.threads": "4",
    "auto.create.topics.enable": "true",
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "10",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "10",
    "share.coordinator.state.topic.replication.factor": "1",
    "share.coordinator.state.topic.min.isr": "1",
    "group.initial.rebalance.delay.ms": "0",
    "log.segment.bytes": str(64 * 1024 * 1024),
}
"""The single-node broker's settings apart from its addresses and log folder (which depend on
the ports and run_dir); docker-compose.yml sets the same as KAFKA_* variables."""
REDIS_MAXMEMORY_MIB = 512
REDIS_MAXMEMORY_POLICY = "noeviction"  # an evicted applied id bills a redelivery twice
REDIS_PERSISTENCE_ARGS: tuple[str, ...] = (
    "--appendonly", "yes", "--appendfsync", "everysec", "--save", "")
"""Every write in the append-only file, synced each second; no RDB snapshots besides."""
JAEGER_MAX_TRACES = 20_000
JAEGER_MEMORY_LIMIT_MIB = 384

INFRA_START_TIMEOUT_S = 180.0
"""How long `start_infra` waits for Kafka, Redis and Jaeger to answer, all together."""
_STOP_TIMEOUT_S = {"kafka": 45.0, "redis": 15.0, "jaeger": 15.0}
SERVICE_STOP_TIMEOUT_S = {"agent": 60.0, "router": 30.0}
"""SIGTERM to SIGKILL when `stop` stops a service, by its name's first part (15 s for the
rest). An agent drains for its GPUSCHED_DRAIN_TIMEOUT_S (20 s), gives what still runs 10 s
more to be handed back, then reports its node stopped and flushes its records and spans:
killed at 15 s, its work took the crash-recovery path instead. A router gives the requests
its clients wait on its GPUSCHED_ROUTER_DRAIN_S (10 s), then answers those clients: killed
first, they were cut off with no answer. docker-compose.yml's stop_grace_period is the same
for every container (`stop_timeout_s`); Kubernetes gives an agent the same 60 s, and a
router 5 s more (35 s), as it first pauses 5 s (preStop) while its pod leaves the Service's
endpoints."""
_POLL_S = 0.25
LOG_TAIL_LINES = 40
"""Lines of a process's log shown where it failed (its start, a stack test)."""
# Popen objects are kept for the life of the interpreter: they reap their child when it exits
# and are never garbage-collected while it runs (which would warn about a running subprocess).
_SPAWNED: list[subprocess.Popen[bytes]] = []


class StackError(RuntimeError):
    """A stack process could not be installed, started, reached or stopped; says what to do."""


@dataclass(frozen=True)
class StackPorts:
    """TCP ports on 127.0.0.1 of one stack; the defaults are those of `gpusched up`."""

    kafka: int = 9092
    kafka_controller: int = 9093
    redis: int = 6379
    jaeger_otlp_grpc: int = 4317
    jaeger_otlp_http: int = 4318
    jaeger_query: int = 16686


@dataclass(frozen=True)
class StackEndpoints:
    """How clients reach a running stack (local processes or containers)."""

    kafka_bootstrap: str  # "127.0.0.1:9092"
    redis_url: str  # "redis://127.0.0.1:6379/0"
    otlp_http_endpoint: str  # "http://127.0.0.1:4318"
    jaeger_query_url: str  # "http://127.0.0.1:16686"


@dataclass(frozen=True)
class ServiceSpec:
    """A gpusched service run as `sys.executable -m <module>` with env merged over os.environ."""

    name: str  # "router", "agent-node-1"; never one of INFRA_COMPONENTS
    module: str
    env: dict[str, str] = field(default_factory=dict)
    health_url: str | None = None  # started = this URL answers GET with 200


@dataclass(frozen=True)
class ProcessStatus:
    """One stack process as seen from its pid file; rss_mib includes its child processes."""

    name: str
    pid: int | None
    alive: bool
    rss_mib: float | None
    log_path: Path


@dataclass(frozen=True)
class _Launch:
    """How to start one process and how to tell it is ready."""

    argv: list[str]
    env: dict[str, str]
    ports: tuple[int, ...]
    ready: Callable[[], bool]
    cwd: Path | None = None  # None: run_dir


def jaeger_env(host: str, ports: StackPorts) -> dict[str, str]:
    """What ops/stack/jaeger/config.yaml reads from the environment, for a Jaeger listening on
    `host` ("127.0.0.1" here; "0.0.0.0" in a container) at `ports`."""
    return {
        "JAEGER_OTLP_GRPC_ENDPOINT": f"{host}:{ports.jaeger_otlp_grpc}",
        "JAEGER_OTLP_HTTP_ENDPOINT": f"{host}:{ports.jaeger_otlp_http}",
        "JAEGER_QUERY_HTTP_ENDPOINT": f"{host}:{ports.jaeger_query}",
        "JAEGER_MAX_TRACES": str(JAEGER_MAX_TRACES),
        "JAEGER_MEMORY_LIMIT_MIB": str(JAEGER_MEMORY_LIMIT_MIB),
        "GOMEMLIMIT": f"{JAEGER_MEMORY_LIMIT_MIB + 64}MiB",
    }


def stop_timeout_s(name: str) -> float:
    """Seconds from SIGTERM to SIGKILL when the stack stops the process `name` ("kafka",
    "router", "agent-node-1"): an infrastructure component's own, else its service's."""
    if name in _STOP_TIMEOUT_S:
        return _STOP_TIMEOUT_S[name]
    return SERVICE_STOP_TIMEOUT_S.get(name.split("-")[0], 15.0)


def default_cache_dir() -> Path:
    """Where install scripts put Kafka jars and the Jaeger binary: $GPUSCHED_CACHE or ~/.cache."""
    configured = os.environ.get("GPUSCHED_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "gpusched"


def find_repo_root() -> Path:
    """The gpusched checkout (the folder holding ops/scripts/install-all.sh).

    Looks above this file (editable install), then $GPUSCHED_REPO_ROOT, then the working
    directory and its parents; raises StackError when none holds the ops scripts.
    """
    marker = Path("ops") / "scripts" / "install-all.sh"
    candidates = list(Path(__file__).resolve().parents)
    if configured := os.environ.get("GPUSCHED_REPO_ROOT"):
        candidates.append(Path(configured))
    cwd = Path.cwd().resolve()
    candidates += [cwd, *cwd.parents]
    for candidate in candidates:
        if (candidate / marker).is_file():
            return candidate
    raise StackError(
        "cannot find the gpusched checkout (ops/scripts/install-all.sh): run from inside the "
        "repository or set GPUSCHED_REPO_ROOT"
    )


def kafka_version(repo_root: Path) -> str:
    """The Kafka version pinned by ops/stack/kafka/pom.xml (the one install-kafka.sh installs)."""
    pom = (repo_root / "ops" / "stack" / "kafka" / "pom.xml").read_text()
    found = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", pom)
    if found is None:
        raise StackError("ops/stack/kafka/pom.xml has no <kafka.version> property")
    return found.group(1).strip()


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last `lines` lines of the log at `path`, read from its last 64 KiB (a log grows
    through a whole session)."""
    with path.open("rb") as log:
        log.seek(max(0, log.seek(0, os.SEEK_END) - 64 * 1024))
        return log.read().decode(errors="replace").splitlines()[-lines:]


STOP_ORDER = ("router", "agent-", "scheduler", "accounting")
"""The services `gpusched up` starts (gpusched_ops.services), by name or name prefix, in the
order `stop` stops them: the reverse of their start order. In name order, `down` stopped
accounting before the agents and the router it bills."""


def _stop_rank(name: str) -> tuple[int, str]:
    """Where `name` stops: any service not in STOP_ORDER first (a test's extra instance),
    then STOP_ORDER's."""
    for rank, known in enumerate(STOP_ORDER, 1):
        if name == known or (known.endswith("-") and name.startswith(known)):
            return rank, name
    return 0, name


class LocalStack:
    """The stack's processes under run_dir: pids/<name>.pid, logs/<name>.log, data/<name>/.

    Processes run in their own session, so they outlive the Python process that started them;
    any LocalStack on the same run_dir sees, reports and stops them.
    """

    def __init__(
        self, run_dir: Path, ports: StackPorts = StackPorts(), cache_dir: Path | None = None
    ) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.ports = ports
        self.cache_dir = (cache_dir or default_cache_dir()).resolve()

    # -- public API ---------------------------------------------------------------------------

    def install(self) -> None:
        """Run ops/scripts/install-all.sh (idempotent; prints a line per thing installed)."""
        script = find_repo_root() / "ops" / "scripts" / "install-all.sh"
        env = {**os.environ, "GPUSCHED_CACHE": str(self.cache_dir)}
        result = subprocess.run(["bash", str(script)], env=env, check=False)
        if result.returncode != 0:
            raise StackError(f"{script} failed with status {result.returncode}; see its output")

    def endpoints(self) -> StackEndpoints:
        """Endpoints for this stack's ports (whether or not it is running)."""
        return StackEndpoints(
            kafka_bootstrap=f"127.0.0.1:{self.ports.kafka}",
            redis_url=f"redis://127.0.0.1:{self.ports.redis}/0",
            otlp_http_endpoint=f"http://127.0.0.1:{self.ports.jaeger_otlp_http}",
            jaeger_query_url=f"http://127.0.0.1:{self.ports.jaeger_query}",
        )

    def start_infra(self, timeout_s: float = INFRA_START_TIMEOUT_S) -> StackEndpoints:
        """Start Kafka, Redis and Jaeger (those not already running) and wait until each answers.

        Idempotent. Either returns with all three ready, or raises StackError after stopping
        whatever this call started; the message carries the failing process's log tail.
        """
        self._check_ports_match_run_dir()
        launches = {name: self._launch(name) for name in INFRA_COMPONENTS}
        deadline = time.monotonic() + timeout_s
        started: list[str] = []
        try:
            for name in INFRA_COMPONENTS:
                if self._start_process(name, launches[name]):
                    started.append(name)
            for name in INFRA_COMPONENTS:
                self._wait_ready(name, launches[name].ready, deadline)
        except BaseException:
            for name in reversed(started):
                self._terminate(name, stop_timeout_s(name))
            raise
        self._ports_file().write_text(json.dumps(asdict(self.ports)))
        return self.endpoints()

    def start_component(self, name: str, timeout_s: float = 180) -> None:
        """Start one infrastructure component ("kafka", "redis", "jaeger") and wait until ready.

        Idempotent; Redis and Kafka come back with the data they had (fault tests).
        """
        self._check_infra_name(name)
        launch = self._launch(name)
        started = self._start_process(name, launch)
        try:
            self._wait_ready(name, launch.ready, time.monotonic() + timeout_s)
        except BaseException:
            if started:
                self._terminate(name, stop_timeout_s(name))
            raise

    def stop_component(self, name: str) -> None:
        """Stop one infrastructure component gracefully (SIGTERM, SIGKILL past its timeout)."""
        self._check_infra_name(name)
        self._terminate(name, stop_timeout_s(name))

    def start_service(self, spec: ServiceSpec, timeout_s: float = 60) -> None:
        """Start a service and wait until its health_url answers 200.

        Idempotent for a running service of that name. On failure the process is stopped and
        StackError carries its log tail.
        """
        if spec.name in INFRA_COMPONENTS or not re.fullmatch(r"[A-Za-z0-9][\w.-]*", spec.name):
            raise ValueError(f"invalid service name {spec.name!r}")
        health_port = urlsplit(spec.health_url).port if spec.health_url else None
        spawned_at = time.monotonic()

        def ready() -> bool:
            if spec.health_url is None:
                return time.monotonic() - spawned_at > 1.0  # survived its imports
            return http_ready(spec.health_url)

        launch = _Launch(
            argv=[sys.executable, "-m", spec.module],
            env={**os.environ, **spec.env},
            ports=(health_port,) if health_port else (),
            ready=ready,
            cwd=_repo_root_or_none(),
        )
        started = self._start_process(spec.name, launch)
        try:
            self._wait_ready(spec.name, ready, time.monotonic() + timeout_s)
        except BaseException:
            if started:
                self._terminate(spec.name, 5.0)
            raise

    def stop_service(self, name: str, timeout_s: float = 15) -> None:
        """SIGTERM the service's process group, SIGKILL it past timeout_s; no-op if not running."""
        self._terminate(name, timeout_s)

    def kill_service(self, name: str) -> None:
        """SIGKILL the service's process group at once (crash simulation for fault tests)."""
        self._terminate(name, 0.0)

    def stop(self) -> None:
        """Stop everything in run_dir: the services in the reverse of `up`'s start order
        (others first, then the router, the agents, the scheduler, and accounting, which
        bills the work stopped before it), then jaeger, redis, kafka. Idempotent."""
        for name in (*sorted(self._service_names(), key=_stop_rank), *reversed(INFRA_COMPONENTS)):
            self._terminate(name, stop_timeout_s(name))

    def status(self) -> list[ProcessStatus]:
        """The infrastructure components, then every service with a pid file, in name order."""
        statuses = []
        for name in (*INFRA_COMPONENTS, *self._service_names()):
            proc = self._process(name)
            statuses.append(
                ProcessStatus(
                    name=name,
                    pid=proc.pid if proc else None,
                    alive=proc is not None,
                    rss_mib=_rss_mib(proc) if proc else None,
                    log_path=self.log_path(name),
                )
            )
        return statuses

    @property
    def log_dir(self) -> Path:
        """The folder of every process's log."""
        return self.run_dir / "logs"

    def log_path(self, name: str) -> Path:
        """Where the process `name` writes its stdout and stderr (appended across restarts)."""
        return self.log_dir / f"{name}.log"

    def data_dir(self, name: str) -> Path:
        """The persistent data folder of component `name`."""
        return self.run_dir / "data" / name

    # -- launching ----------------------------------------------------------------------------

    def _launch(self, name: str) -> _Launch:
        builders = {"kafka": self._kafka_launch, "redis": self._redis_launch}
        return builders.get(name, self._jaeger_launch)()

    def _kafka_launch(self) -> _Launch:
        root = find_repo_root()
        libs = self.cache_dir / f"kafka-{kafka_version(root)}" / "libs"
        if not (libs.parent / ".complete").is_file():
            raise StackError(f"Kafka is not installed in {libs.parent}: {_INSTALL_HINT}")
        java = _java()
        conf = self._write_kafka_config()
        jvm = [
            java,
            *KAFKA_JVM_FLAGS,
            f"-Dlog4j2.configurationFile={root / 'ops' / 'stack' / 'kafka' / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.log_dir}",
            "-cp",
            f"{libs}/*",
        ]
        if not (self.data_dir("kafka") / "meta.properties").is_file():
            self._format_kafka_storage(jvm, conf)
        bootstrap = self.endpoints().kafka_bootstrap
        return _Launch(
            argv=[*jvm, "kafka.Kafka", str(conf)],
            env=dict(os.environ),
            ports=(self.ports.kafka, self.ports.kafka_controller),
            ready=lambda: _port_open(self.ports.kafka) and kafka_ready(bootstrap),
        )

    def _write_kafka_config(self) -> Path:
        """Single-node KRaft (broker+controller) config; returns its path under run_dir/conf."""
        p = self.ports
        settings = {
            **KAFKA_BROKER_SETTINGS,
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{p.kafka_controller}",
            "listeners": f"PLAINTEXT://127.0.0.1:{p.kafka},CONTROLLER://127.0.0.1:{p.kafka_controller}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{p.kafka},"
            f"CONTROLLER://127.0.0.1:{p.kafka_controller}",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(self.data_dir("kafka")),
        }
        conf = self.run_dir / "conf" / "kafka.properties"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
        return conf

    def _format_kafka_storage(self, jvm: list[str], conf: Path) -> None:
        """Format the KRaft log dir once (standalone controller quorum, random cluster id)."""
        self.data_dir("kafka").mkdir(parents=True, exist_ok=True)
        argv = [*jvm, "kafka.tools.StorageTool", "format", "--standalone", "--ignore-formatted"]
        argv += ["--cluster-id", _kafka_cluster_id(), "--config", str(conf)]
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise StackError(
                f"formatting Kafka storage in {self.data_dir('kafka')} failed "
                f"(status {result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}"
            )

    def _redis_launch(self) -> _Launch:
        redis = shutil.which("redis-server")
        if redis is None:
            raise StackError(f"redis-server is not on PATH: {_INSTALL_HINT}")
        data = self.data_dir("redis")
        data.mkdir(parents=True, exist_ok=True)
        argv = [redis, "--port", str(self.ports.redis), "--bind", "127.0.0.1"]
        argv += ["--dir", str(data), *REDIS_PERSISTENCE_ARGS]
        argv += ["--daemonize", "no", "--protected-mode", "yes", "--logfile", ""]
        argv += ["--maxmemory", f"{REDIS_MAXMEMORY_MIB}mb",
                 "--maxmemory-policy", REDIS_MAXMEMORY_POLICY]
        return _Launch(
            argv=argv,
            env=dict(os.environ),
            ports=(self.ports.redis,),
            ready=lambda: redis_ready(self.ports.redis),
        )

    def _jaeger_launch(self) -> _Launch:
        binary = self.cache_dir / "bin" / "jaeger"
        if not os.access(binary, os.X_OK):
            raise StackError(f"Jaeger is not installed at {binary}: {_INSTALL_HINT}")
        p = self.ports
        env = {**os.environ, **jaeger_env("127.0.0.1", p)}
        config = find_repo_root() / "ops" / "stack" / "jaeger" / "config.yaml"
        services_url = f"{self.endpoints().jaeger_query_url}/api/services"
        return _Launch(
            argv=[str(binary), "--config", str(config)],
            env=env,
            ports=(p.jaeger_otlp_grpc, p.jaeger_otlp_http, p.jaeger_query),
            ready=lambda: _port_open(p.jaeger_otlp_http) and http_ready(services_url),
        )

    # -- processes ----------------------------------------------------------------------------

    def _start_process(self, name: str, launch: _Launch) -> bool:
        """Spawn `name` in its own session unless it runs already; True if spawned now."""
        if self._process(name) is not None:
            return False
        for port in launch.ports:
            if _port_in_use(port):
                raise StackError(
                    f"port {port} needed by {name} is already in use by {_port_owner(port)}, "
                    f"which is not part of the stack in {self.run_dir}; stop it (`gpusched down` "
                    "if it is another gpusched stack) or choose other ports"
                )
        log = self.log_path(name)
        log.parent.mkdir(parents=True, exist_ok=True)
        pid_file = self._pid_file(name)
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            out.write(f"--- {stamp} gpusched starting {name}: {shlex.join(launch.argv)}\n".encode())
            out.flush()
            proc = subprocess.Popen(
                launch.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=launch.env,
                cwd=launch.cwd or self.run_dir,
                start_new_session=True,
            )
        _SPAWNED.append(proc)
        try:
            created = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:
            created = 0.0  # already gone: _wait_ready reports it with the log tail
        # also its start after boot, which a step of the wall clock does not move
        pid_file.write_text(f"{proc.pid}\n{created!r}\n{created - psutil.boot_time()!r}\n")
        return True

    def _wait_ready(self, name: str, ready: Callable[[], bool], deadline: float) -> None:
        while True:
            if self._process(name) is None:
                raise StackError(f"{name} exited during startup; {self._log_tail(name)}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise StackError(f"{name} was not ready in time; {self._log_tail(name)}")
            time.sleep(_POLL_S)

    def _process(self, name: str) -> psutil.Process | None:
        """The live process recorded in pids/<name>.pid, or None (no file, exited, pid reused)."""
        try:
            fields = [float(f) for f in self._pid_file(name).read_text().split()]
            pid = int(fields[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None
        try:
            proc = psutil.Process(pid)
            # psutil dates a start from the boot time the wall clock implies now, so once the
            # clock was stepped (NTP) the recorded date no longer matched and the stack's own
            # processes were taken for strangers: `down` forgot them running
            if len(fields) > 2:
                if abs(proc.create_time() - psutil.boot_time() - fields[2]) > 0.01:
                    return None
            elif len(fields) > 1 and abs(proc.create_time() - fields[1]) > 0.01:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                _reap(pid)
                return None
            return proc
        except psutil.NoSuchProcess:
            return None

    def _terminate(self, name: str, timeout_s: float) -> None:
        """Stop `name` and its process group: SIGTERM, then SIGKILL after timeout_s (0: at once)."""
        proc = self._process(name)
        if proc is not None:
            group = _leads_group(proc.pid)
            if timeout_s > 0:
                _send(proc.pid, signal.SIGTERM, group)
                _, alive = psutil.wait_procs([proc], timeout=timeout_s)
            else:
                alive = [proc]
            _send(proc.pid, signal.SIGKILL, group)  # also ends stragglers left in the group
            psutil.wait_procs(alive, timeout=10)
            _reap(proc.pid)
        self._pid_file(name).unlink(missing_ok=True)

    def _service_names(self) -> list[str]:
        pids = self.run_dir / "pids"
        names = sorted(path.stem for path in pids.glob("*.pid")) if pids.is_dir() else []
        return [name for name in names if name not in INFRA_COMPONENTS]

    def _pid_file(self, name: str) -> Path:
        return self.run_dir / "pids" / f"{name}.pid"

    def _ports_file(self) -> Path:
        return self.run_dir / "ports.json"

    def _log_tail(self, name: str) -> str:
        path = self.log_path(name)
        try:
            lines = log_tail(path)
        except FileNotFoundError:
            return f"no log at {path}"
        return f"last lines of {path}:\n" + "\n".join(lines)

    def _check_infra_name(self, name: str) -> None:
        if name not in INFRA_COMPONENTS:
            raise ValueError(f"unknown component {name!r}; expected one of {INFRA_COMPONENTS}")

    def _check_ports_match_run_dir(self) -> None:
        """Refuse ports that contradict what runs (or Kafka's formatted data) in run_dir."""
        try:
            recorded = StackPorts(**json.loads(self._ports_file().read_text()))
        except (FileNotFoundError, ValueError, TypeError):
            return
        if recorded == self.ports:
            return
        running = [name for name in INFRA_COMPONENTS if self._process(name) is not None]
        kafka_data = (self.data_dir("kafka") / "meta.properties").is_file()
        if running or (kafka_data and recorded.kafka_controller != self.ports.kafka_controller):
            raise StackError(
                f"the stack in {self.run_dir} was started with {recorded} (running: "
                f"{', '.join(running) or 'none'}), not {self.ports}; stop it and use the same "
                f"ports, or use another run directory"
            )


def _repo_root_or_none() -> Path | None:
    try:
        return find_repo_root()
    except StackError:
        return None


_INSTALL_HINT = "run ops/scripts/install-all.sh (or LocalStack.install()) first"


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not os.access(java, os.X_OK):
        raise StackError(f"no java on JAVA_HOME or PATH; Kafka needs Java 17+: {_INSTALL_HINT}")
    return java


def _kafka_cluster_id() -> str:
    """A random Kafka cluster id: 16 bytes in unpadded URL-safe base64, not starting with '-'."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _port_owner(port: int) -> str:
    """Best-effort description of the process listening on `port`."""
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                if conn.pid is None:
                    break
                return f"pid {conn.pid} ({psutil.Process(conn.pid).name()})"
    except (psutil.Error, OSError):
        pass
    return "another process"


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def redis_ready(port: int, host: str = "127.0.0.1") -> bool:
    """True when Redis answers PING with PONG (not while it is still loading its AOF)."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def http_ready(url: str) -> bool:
    """True when GET `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def kafka_ready(bootstrap: str) -> bool:
    """True when the broker at `bootstrap` answers a metadata request (aiokafka list_topics)."""

    async def probe() -> bool:
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            await admin.list_topics()
            return True
        finally:
            await admin.close()

    try:
        return _run_coroutine(probe())
    except Exception:
        return False


def _run_coroutine(coro: Coroutine[Any, Any, bool]) -> bool:
    """Run `coro` on a fresh event loop in a worker thread (safe inside a running loop)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _leads_group(pid: int) -> bool:
    """True when `pid` leads its process group (ours do: each runs in its own session)."""
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _send(pid: int, sig: signal.Signals, group: bool) -> None:
    """Send `sig` to the process group `pid` leads (group=True) or to `pid` alone."""
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _reap(pid: int) -> None:
    """Collect the exit status of `pid` if it is our exited child; no-op otherwise."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _rss_mib(proc: psutil.Process) -> float | None:
    try:
        members = [proc, *proc.children(recursive=True)]
        total = 0
        for member in members:
            try:
                total += member.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return round(total / (1024 * 1024), 1)
    except psutil.Error:
        return None
