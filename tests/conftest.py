"""Test harness: one session-scoped running stack for integration tests.

Kafka, Redis and Jaeger come from the same local process stack as `gpusched up` (on test
ports), or from testcontainers with GPUSCHED_TEST_CONTAINERS=1; the gpusched services then
run as local processes against either. Unit tests never touch it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from _pytest.reports import TestReport
from stack_helpers import INFRA_PORTS, SERVICE_TEST_ENV, TEST_SERVICE_PORTS

from gpusched_ops.services import service_specs
from gpusched_ops.stack import (
    LOG_TAIL_LINES,
    LocalStack,
    StackEndpoints,
    default_cache_dir,
    log_tail,
)
from gpusched_ops.testing import start_test_stack

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@dataclass(frozen=True)
class RunningStack:
    endpoints: StackEndpoints
    processes: LocalStack
    """Starts, stops and kills service processes (and, on the process stack, infra) for fault
    tests: see `local_infra`."""
    router_url: str
    scheduler_url: str
    accounting_url: str
    infra_in_containers: bool
    """Kafka, Redis and Jaeger run in containers: `processes` cannot stop or start them."""


def _stop_earlier_session(run_dir: Path) -> None:
    """A session killed before its teardown (SIGKILL, a cancelled CI job) left its stack
    running on the test ports, and every later session failed on them: stop what the last
    session recorded, then record this one. A session still running keeps its stack: this
    one stops, saying so."""
    marker = default_cache_dir() / f"test-stack-{INFRA_PORTS.kafka}.dir"
    fields = marker.read_text().split("\n") if marker.is_file() else []
    earlier = Path(fields[0]) if fields and fields[0] else None
    if earlier is not None and earlier != run_dir and earlier.is_dir():
        pid = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None
        if pid is not None and pid != os.getpid() and _is_pytest(pid):
            pytest.exit(f"another test session (pid {pid}) runs its stack on the test ports "
                        f"({earlier}): wait for it to end, or stop it", returncode=1)
        LocalStack(earlier / "services").stop()
        LocalStack(earlier).stop()
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{run_dir}\n{os.getpid()}\n")


def _is_pytest(pid: int) -> bool:
    try:
        return any("pytest" in part for part in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def _interrupt_on_termination() -> None:
    """SIGTERM and SIGHUP (`timeout`, a closed terminal) end the session as Ctrl-C does, so
    the stack's teardown runs; by default they killed pytest and left the stack up. A
    signal ignored already (`nohup`) stays ignored."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, interrupt)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A stack test that fails shows the end of every process log written while it ran (a
    section of its report, printed with the failure): the run's folder is gone by the time
    anyone reads a CI log, and a time-out alone says nothing of why."""
    outcome = yield
    report: TestReport = outcome.get_result()
    running = getattr(item, "funcargs", {}).get("stack")
    if report.failed and report.when == "call" and isinstance(running, RunningStack):
        for name, tail in log_tails(running.processes.log_dir, since=call.start):
            report.sections.append((f"log of {name} (last {LOG_TAIL_LINES} lines)", tail))


def log_tails(log_dir: Path, since: float) -> list[tuple[str, str]]:
    """The last LOG_TAIL_LINES lines of each log in `log_dir` written to at or after `since`
    (a time.time()), by name."""
    tails = []
    for path in sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []:
        try:
            if path.stat().st_mtime >= since:
                tails.append((path.stem, "\n".join(log_tail(path))))
        except OSError:
            continue
    return tails


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    run_dir = Path(os.environ.get("GPUSCHED_TEST_RUN_DIR") or tmp_path_factory.mktemp("stack"))
    _interrupt_on_termination()
    _stop_earlier_session(run_dir.resolve())
    endpoints, stop_infra, local = start_test_stack(run_dir, INFRA_PORTS)
    processes = local or LocalStack(run_dir / "services")
    try:
        for spec in service_specs(endpoints, TEST_SERVICE_PORTS, SERVICE_TEST_ENV):
            # the scheduler compiles its solver kernels on a cold cache: allow for it
            processes.start_service(spec, timeout_s=300)
        p = TEST_SERVICE_PORTS
        yield RunningStack(endpoints, processes, f"http://127.0.0.1:{p.router}",
                           f"http://127.0.0.1:{p.scheduler}", f"http://127.0.0.1:{p.accounting}",
                           infra_in_containers=local is None)
    finally:
        processes.stop()
        stop_infra()


@pytest.fixture
def shared_data() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (fresh clone without ../shared)")
    return SHARED / "data"
