"""Offline checks of docker-compose.yml: it validates against the compose-spec schema and runs
exactly the gpusched stack, each service wired to the shared infrastructure and health-checked,
with the local stack's settings, start order and start and stop time-outs.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpusched_ops.services import SERVICE_START_TIMEOUT_S, service_specs
from gpusched_ops.stack import (
    INFRA_COMPONENTS,
    INFRA_START_TIMEOUT_S,
    KAFKA_BROKER_SETTINGS,
    KAFKA_JVM_FLAGS,
    REDIS_MAXMEMORY_MIB,
    REDIS_MAXMEMORY_POLICY,
    REDIS_PERSISTENCE_ARGS,
    ServiceSpec,
    StackEndpoints,
    StackPorts,
    jaeger_env,
    kafka_version,
    stop_timeout_s,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
INFRA = {"kafka", "redis", "jaeger"}
SERVICE_PORTS = {
    "router": 8080,
    "scheduler": 8081,
    "accounting": 8082,
    "agent-1": 8090,
    "agent-2": 8091,
}


def _compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(loaded, dict)
    return loaded


def _check_jsonschema() -> list[str]:
    """The check-jsonschema command: this interpreter's module, else the one on PATH."""
    if importlib.util.find_spec("check_jsonschema") is not None:
        return [sys.executable, "-m", "check_jsonschema"]
    if executable := shutil.which("check-jsonschema"):
        return [executable]
    pytest.skip("check-jsonschema is not installed (pip install check-jsonschema)")


def test_compose_file_is_valid_against_compose_spec() -> None:
    command = [*_check_jsonschema(), "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_runs_exactly_the_gpusched_stack() -> None:
    assert set(_compose()["services"]) == INFRA | set(SERVICE_PORTS)


@pytest.mark.parametrize("name", sorted(SERVICE_PORTS))
def test_service_is_wired_to_the_stack_and_health_checked(name: str) -> None:
    service = _compose()["services"][name]
    port = SERVICE_PORTS[name]
    env = service["environment"]
    assert service["build"]["context"] == "."
    assert env["GPUSCHED_KAFKA_BOOTSTRAP"] == "kafka:9092"
    assert env["GPUSCHED_REDIS_URL"] == "redis://redis:6379/0"
    assert env["GPUSCHED_OTLP_ENDPOINT"] == "http://jaeger:4318"
    assert env["GPUSCHED_HTTP_PORT"] == str(port)
    assert service["ports"] == [f"127.0.0.1:{port}:{port}"]
    assert f"http://127.0.0.1:{port}/healthz" in " ".join(service["healthcheck"]["test"])
    assert INFRA <= set(service["depends_on"])


def test_agents_simulate_distinct_nodes() -> None:
    services = _compose()["services"]
    agents = [services["agent-1"]["environment"], services["agent-2"]["environment"]]
    assert {env["GPUSCHED_NODE_ID"] for env in agents} == {"node-1", "node-2"}
    assert len({env["GPUSCHED_SIMULATE"] for env in agents}) == 2


def _named_volume_of(compose: dict[str, Any], service: str, path: str) -> str | None:
    """The named volume (declared under top-level `volumes`) that holds `path` in `service`'s
    container, if one does."""
    for entry in compose["services"][service].get("volumes", []):
        source, target = entry.split(":")[:2]
        if f"{path}/".startswith(f"{target.rstrip('/')}/") and source in (
                compose.get("volumes") or {}):
            return source
    return None


def test_compose_keeps_the_local_stacks_durability_and_drain_settings() -> None:
    """Redis keeps every applied id (AOF, never evicting), as the local stack's does; Kafka's
    log and Redis's data are on named volumes, which `docker compose down && up` keeps
    (Kafka's log in the container started each partition at offset 0 again while Redis
    kept its claims and applied ids: a record without request_id reused an earlier one's
    default id and never ran), Kafka's where ops/kubernetes/dev keeps it; an agent gets
    the time to drain before Docker's SIGKILL (its default is 10 s, the drain 20 s: work
    took the crash-recovery path)."""
    from gpusched_agent.settings import AgentSettings

    compose = _compose()
    services = compose["services"]
    redis = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in redis and "--maxmemory-policy noeviction" in redis
    [dev_kafka] = [doc for doc in yaml.safe_load_all(
        (REPO_ROOT / "ops" / "kubernetes" / "dev" / "kafka.yaml").read_text())
        if doc and doc["kind"] == "StatefulSet"]
    [dev_env] = [{e["name"]: e.get("value") for e in c["env"]}
                 for c in dev_kafka["spec"]["template"]["spec"]["containers"]]
    log_dirs = services["kafka"]["environment"].get("KAFKA_LOG_DIRS")
    assert log_dirs == dev_env["KAFKA_LOG_DIRS"]
    assert _named_volume_of(compose, "kafka", log_dirs) is not None
    assert _named_volume_of(compose, "redis", "/data") is not None  # redis:7's AOF there
    drain_s = AgentSettings.model_fields["drain_timeout_s"].default
    for name in ("agent-1", "agent-2"):
        grace = services[name]["stop_grace_period"]
        assert grace.endswith("s") and int(grace[:-1]) >= drain_s + 20


def test_every_published_port_is_on_the_hosts_loopback_alone() -> None:
    """As the local stack listens. Published on every interface, Redis (usage buckets,
    applied ids, budget flags, placement claims) and Kafka took anyone's writes on the
    network, unauthenticated."""
    for name, service in _compose()["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


# Where the containers reach the infrastructure: the local stack's services, given these,
# must have exactly the compose services' settings.
COMPOSE_ENDPOINTS = StackEndpoints(kafka_bootstrap="kafka:9092",
                                   redis_url="redis://redis:6379/0",
                                   otlp_http_endpoint="http://jaeger:4318",
                                   jaeger_query_url="http://jaeger:16686")
CONTAINER_ONLY_ENV = {"GPUSCHED_CONFIG_DIR", "GPUSCHED_HTTP_HOST"}  # the image's folders


def _compose_name(services: dict[str, Any], spec: ServiceSpec) -> str:
    """The compose service that runs the local stack's service `spec` (its module, its node)."""
    [name] = [name for name, service in services.items()
              if service.get("command") == ["python", "-m", spec.module]
              and service["environment"].get("GPUSCHED_NODE_ID") == spec.env.get(
                  "GPUSCHED_NODE_ID")]
    return name


def _seconds(duration: str) -> float:
    found = re.fullmatch(r"(\d+)s", duration)
    assert found, f"{duration!r}: write compose durations in whole seconds"
    return float(found.group(1))


def test_compose_runs_the_local_stacks_services_with_its_settings() -> None:
    """Every service of `gpusched up`, one container each, with its environment: the same
    nodes and GPU inventories for the agents, the same ports."""
    services = _compose()["services"]
    specs = service_specs(COMPOSE_ENDPOINTS)
    assert {_compose_name(services, spec) for spec in specs} == set(services) - INFRA
    for spec in specs:
        env = services[_compose_name(services, spec)]["environment"]
        assert spec.env.items() <= env.items(), spec.name
        assert set(env) - set(spec.env) == CONTAINER_ONLY_ENV, spec.name


def test_compose_starts_the_services_in_the_local_stacks_order() -> None:
    """`gpusched up` starts accounting, the scheduler, the agents, then the router, each once
    the one before answers, all once Kafka, Redis and Jaeger answer. Compose started them
    all at once, before Jaeger answered."""
    services = _compose()["services"]
    healthy = {"condition": "service_healthy"}
    for name in INFRA_COMPONENTS:  # started together, as start_infra does
        assert "depends_on" not in services[name], name
    before: dict[str, Any] = {}
    for spec in service_specs(COMPOSE_ENDPOINTS):
        name = _compose_name(services, spec)
        assert services[name]["depends_on"] == {
            **dict.fromkeys(INFRA_COMPONENTS, healthy), **before}, name
        before = {name: healthy}


def test_compose_gives_each_container_the_local_stacks_time_to_start_and_stop() -> None:
    """A container is unhealthy when the local stack would give up on its process (a
    scheduler with a cold solver cache first compiles its kernels, up to a minute on 2
    cores: Compose gave up at 80 s), and is SIGKILLed when the local stack would kill it
    (Compose gave Kafka, Redis, Jaeger, the scheduler and accounting Docker's 10 s)."""
    services = _compose()["services"]
    local_names = {name: name for name in INFRA_COMPONENTS} | {
        _compose_name(services, spec): spec.name for spec in service_specs(COMPOSE_ENDPOINTS)}
    assert set(local_names) == set(services)
    for name, service in services.items():
        grace = service.get("stop_grace_period", "10s")  # Docker's default
        assert _seconds(grace) == stop_timeout_s(local_names[name]), name
        assert "healthcheck" in service, name
        wait_s = INFRA_START_TIMEOUT_S if name in INFRA_COMPONENTS else SERVICE_START_TIMEOUT_S
        assert _seconds(service["healthcheck"]["start_period"]) == wait_s, name


def test_compose_runs_kafka_as_the_local_stack_does() -> None:
    """The local stack's Kafka version, broker settings (threads, partitions, segments) and
    JVM flags (Compose's lacked the off-heap bounds)."""
    kafka = _compose()["services"]["kafka"]
    assert kafka["image"] == f"apache/kafka:{kafka_version(REPO_ROOT)}"
    env = kafka["environment"]
    for key, value in KAFKA_BROKER_SETTINGS.items():  # the image's KAFKA_A_B is a.b
        assert env.get("KAFKA_" + key.upper().replace(".", "_")) == value, key
    jvm = env["KAFKA_HEAP_OPTS"].split() + env["KAFKA_JVM_PERFORMANCE_OPTS"].split()
    assert jvm == list(KAFKA_JVM_FLAGS)  # kafka-run-class.sh passes them in this order


def test_compose_runs_redis_as_the_local_stack_does() -> None:
    """The local stack's Redis version and settings: its persistence (the append-only file
    alone: Redis's default save points also wrote RDB snapshots, forking the server), its
    memory bound, never evicting."""
    redis = _compose()["services"]["redis"]
    # 7.0.x, as Debian's redis-server (bookworm, Ubuntu 24.04); redis:7 floated to 7.2 and on
    assert re.fullmatch(r"redis:7\.0\.\d+", redis["image"]), redis["image"]
    command = redis["command"]
    assert command[0] == "redis-server"
    args = dict(zip(command[1::2], command[2::2], strict=True))
    assert args == {**dict(zip(REDIS_PERSISTENCE_ARGS[::2], REDIS_PERSISTENCE_ARGS[1::2],
                               strict=True)),
                    "--maxmemory": f"{REDIS_MAXMEMORY_MIB}mb",
                    "--maxmemory-policy": REDIS_MAXMEMORY_POLICY}


def test_compose_runs_jaeger_as_the_local_stack_does() -> None:
    """The local stack's Jaeger settings (store limits, endpoints), ready when it takes it so:
    with no health check, Compose started the services before Jaeger listened."""
    jaeger = _compose()["services"]["jaeger"]
    ports = StackPorts()
    assert jaeger["environment"] == jaeger_env("0.0.0.0", ports)
    # ready as start_infra takes it: the query API answers (wget: the image is Alpine's)
    probe = jaeger["healthcheck"]["test"]
    assert probe[:2] == ["CMD", "wget"]
    assert probe[-1] == f"http://127.0.0.1:{ports.jaeger_query}/api/services"


def test_the_scheduler_keeps_its_compiled_kernels_across_down_and_up() -> None:
    """The image cannot write Numba's cache beside the installed code, and the fallback in
    the user's home went with each container: a scheduler compiled its solver kernels at
    every `docker compose up` (about a minute on 2 cores). The image names a cache folder
    its user owns, and Compose keeps it on a named volume (a new volume takes the owner of
    the folder it is mounted on)."""
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    [cache_dir] = re.findall(r"^ENV NUMBA_CACHE_DIR=(\S+)$", dockerfile, re.MULTILINE)
    [user] = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert f'install -d -o {user} -g {user} "$NUMBA_CACHE_DIR"' in dockerfile
    assert _named_volume_of(_compose(), "scheduler", cache_dir) is not None
