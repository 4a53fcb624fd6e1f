"""Test harness: one session-scoped running stack for integration tests.

Kafka, Redis and Jaeger come from testcontainers where a Docker engine answers, else from
the same local process stack as `gpusched up` (on test ports); the gpusched services then
run as local processes against either. Unit tests never touch it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from stack_helpers import INFRA_PORTS, SERVICE_TEST_ENV, TEST_SERVICE_PORTS

from gpusched_ops.services import service_specs
from gpusched_ops.stack import LocalStack, StackEndpoints
from gpusched_ops.testing import start_test_stack

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@dataclass(frozen=True)
class RunningStack:
    endpoints: StackEndpoints
    processes: LocalStack
    """Starts, stops and kills service processes (and, without Docker, infra) for fault tests."""
    router_url: str
    scheduler_url: str
    accounting_url: str


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    run_dir = Path(os.environ.get("GPUSCHED_TEST_RUN_DIR") or tmp_path_factory.mktemp("stack"))
    endpoints, stop_infra, local = start_test_stack(run_dir, INFRA_PORTS)
    processes = local or LocalStack(run_dir / "services")
    try:
        for spec in service_specs(endpoints, TEST_SERVICE_PORTS, SERVICE_TEST_ENV):
            # the scheduler compiles its solver kernels on a cold cache: allow for it
            processes.start_service(spec, timeout_s=300)
        p = TEST_SERVICE_PORTS
        yield RunningStack(endpoints, processes, f"http://127.0.0.1:{p.router}",
                           f"http://127.0.0.1:{p.scheduler}", f"http://127.0.0.1:{p.accounting}")
    finally:
        processes.stop()
        stop_infra()


@pytest.fixture
def shared_data() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (fresh clone without ../shared)")
    return SHARED / "data"
