"""Test-stack fixture backend: Kafka, Redis and Jaeger as local processes (LocalStack on
TEST_PORTS, clear of a running dev stack), the stack `make test` installs and CI runs; or,
asked for with GPUSCHED_TEST_CONTAINERS=1, from Docker containers (testcontainers).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpusched_ops.stack import (
    LocalStack,
    StackEndpoints,
    StackError,
    StackPorts,
    http_ready,
    kafka_ready,
    redis_ready,
)

__all__ = [
    "KAFKA_IMAGE",
    "JAEGER_IMAGE",
    "REDIS_IMAGE",
    "TEST_PORTS",
    "CONTAINERS_ENV",
    "docker_available",
    "start_redis",
    "start_test_stack",
]

CONTAINERS_ENV = "GPUSCHED_TEST_CONTAINERS"
"""Set to 1 (or true, yes), the test stack's Kafka, Redis and Jaeger run in Docker
containers. The tests that stop, restart or pause Kafka or Redis then skip: only the
process stack does that.
Chosen whenever an engine answered, those tests failed on every machine with Docker (they
stopped nothing and started a second Redis and Kafka on the default ports)."""

# Ports of the process-backed test stack: none of them is a default of `gpusched up`.
TEST_PORTS = StackPorts(
    kafka=29092,
    kafka_controller=29093,
    redis=26379,
    jaeger_otlp_grpc=24317,
    jaeger_otlp_http=24318,
    jaeger_query=26686,
)
# Same versions as ops/stack/kafka/pom.xml and ops/scripts/install-jaeger.sh (v1.76.0 = 2.13.0).
KAFKA_IMAGE = "apache/kafka:4.4.0"
REDIS_IMAGE = "redis:7"
JAEGER_IMAGE = "jaegertracing/jaeger:2.13.0"
_CONTAINER_READY_TIMEOUT_S = 180.0


def docker_available(timeout_s: float = 2.0) -> bool:
    """True when a Docker engine answers a ping within timeout_s (a docker CLI is not enough)."""
    try:
        import docker

        client = docker.from_env(timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def start_test_stack(
    run_dir: Path, ports: StackPorts = TEST_PORTS,
) -> tuple[StackEndpoints, Callable[[], None], LocalStack | None]:
    """Start Kafka, Redis and Jaeger for a test session and wait until each answers.

    `ports` applies to the process stack only (containers get free host ports).
    Returns (endpoints, stop, stack): `stop` tears everything down and is idempotent; `stack`
    is the LocalStack (for starting services and fault injection) or None with containers
    (CONTAINERS_ENV). Nothing is left running when this raises.
    """
    if os.environ.get(CONTAINERS_ENV, "").lower() in ("1", "true", "yes"):
        if not docker_available():
            raise StackError(f"{CONTAINERS_ENV} asks for containers, but no Docker engine "
                             "answers; unset it to run the stack as local processes")
        endpoints, stop = _start_containers()
        return endpoints, stop, None
    stack = LocalStack(run_dir, ports)
    stack.install()
    try:
        endpoints = stack.start_infra()
    except BaseException:
        stack.stop()
        raise
    return endpoints, stack.stop, stack


def _start_containers() -> tuple[StackEndpoints, Callable[[], None]]:
    """Kafka, Redis and Jaeger via testcontainers, each on a free host port picked up front.

    Kafka must advertise the host address clients use, so its host port is fixed before start.
    """
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.docker_client import DockerClient

    host = DockerClient().host()
    kafka_port, redis_port, otlp_http_port, query_port = (_free_port() for _ in range(4))
    kafka = DockerContainer(KAFKA_IMAGE).with_bind_ports(9092, kafka_port)
    kafka_env = {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": "PLAINTEXT://:9092,CONTROLLER://:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://{host}:{kafka_port}",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_NUM_PARTITIONS": "3",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_HEAP_OPTS": "-Xms256m -Xmx512m",
    }
    for key, value in kafka_env.items():
        kafka.with_env(key, value)
    redis = (
        DockerContainer(REDIS_IMAGE)
        .with_bind_ports(6379, redis_port)
        .with_command("redis-server --appendonly yes")
    )
    jaeger = (
        DockerContainer(JAEGER_IMAGE)
        .with_bind_ports(4318, otlp_http_port)
        .with_bind_ports(16686, query_port)
    )
    endpoints = StackEndpoints(
        kafka_bootstrap=f"{host}:{kafka_port}",
        redis_url=f"redis://{host}:{redis_port}/0",
        otlp_http_endpoint=f"http://{host}:{otlp_http_port}",
        jaeger_query_url=f"http://{host}:{query_port}",
    )
    started: list[Any] = []

    def stop() -> None:
        while started:
            started.pop().stop()

    try:
        for container in (kafka, redis, jaeger):
            container.start()
            started.append(container)
        _wait_until("kafka", lambda: kafka_ready(endpoints.kafka_bootstrap), kafka)
        _wait_until("redis", lambda: redis_ready(redis_port, host), redis)
        services_url = f"{endpoints.jaeger_query_url}/api/services"
        _wait_until("jaeger", lambda: http_ready(services_url), jaeger)
    except BaseException:
        stop()
        raise
    return endpoints, stop


def _wait_until(name: str, ready: Callable[[], bool], container: Any) -> None:
    deadline = time.monotonic() + _CONTAINER_READY_TIMEOUT_S
    while not ready():
        if time.monotonic() > deadline:
            stdout, stderr = container.get_logs()
            tail = (stdout + stderr).decode(errors="replace")[-4000:]
            raise StackError(f"{name} container was not ready in time; its log ends:\n{tail}")
        time.sleep(0.5)


def _free_port() -> int:
    """A TCP port free on this host right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis(run_dir: Path) -> tuple[str, Callable[[], None]]:
    """A Redis of its own, as the local stack runs it, on a free port: for tests of what only
    Redis's scripts decide, without the whole stack. Returns its URL and how to stop it.
    Raises StackError where redis-server is not installed."""
    local = LocalStack(run_dir, StackPorts(redis=_free_port()))
    local.start_component("redis", timeout_s=30)
    return f"redis://127.0.0.1:{local.ports.redis}/0", local.stop
