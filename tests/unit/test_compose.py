"""Offline checks of docker-compose.yml: it validates against the compose-spec schema and runs
exactly the gpusched stack, each service wired to the shared infrastructure and health-checked.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

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
    assert set(service["depends_on"]) == INFRA


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
