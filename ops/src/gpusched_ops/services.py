"""The four gpusched services as local processes: ports, environment and health URLs.

Same shape as docker-compose.yml (two simulated agents: node-1 4xH100, node-2 4xA100).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpusched_ops.stack import ServiceSpec, StackEndpoints

AGENT_NODES: tuple[tuple[str, str], ...] = (("node-1", "4xH100-80GB"), ("node-2", "4xA100-40GB"))
SERVICE_START_TIMEOUT_S = 300.0
"""How long `gpusched up` waits for each service to answer /healthz: a scheduler whose solver
cache is cold compiles its kernels first (up to a minute on 2 cores)."""


@dataclass(frozen=True)
class ServicePorts:
    router: int = 8080
    scheduler: int = 8081
    accounting: int = 8082
    first_agent: int = 8090

    def agent(self, i: int) -> int:
        return self.first_agent + i


def service_specs(endpoints: StackEndpoints, ports: ServicePorts = ServicePorts(),
                  extra_env: dict[str, str] | None = None,
                  agents: tuple[tuple[str, str], ...] = AGENT_NODES) -> list[ServiceSpec]:
    """Specs in start order: accounting and scheduler before the agents and the router; each
    starts once the one before it answers (docker-compose.yml's depends_on is this chain)."""
    base = {
        "GPUSCHED_KAFKA_BOOTSTRAP": endpoints.kafka_bootstrap,
        "GPUSCHED_REDIS_URL": endpoints.redis_url,
        "GPUSCHED_OTLP_ENDPOINT": endpoints.otlp_http_endpoint,
        **(extra_env or {}),
    }

    def spec(name: str, module: str, port: int, **env: str) -> ServiceSpec:
        return ServiceSpec(name=name, module=module,
                           env={**base, "GPUSCHED_HTTP_PORT": str(port), **env},
                           health_url=f"http://127.0.0.1:{port}/healthz")

    specs = [
        spec("accounting", "gpusched_accounting", ports.accounting),
        spec("scheduler", "gpusched_scheduler", ports.scheduler),
    ]
    for i, (node_id, inventory) in enumerate(agents):
        specs.append(spec(f"agent-{node_id}", "gpusched_agent", ports.agent(i),
                          GPUSCHED_NODE_ID=node_id, GPUSCHED_SIMULATE=inventory))
    specs.append(spec("router", "gpusched_router", ports.router))
    return specs


def urls(ports: ServicePorts = ServicePorts()) -> dict[str, str]:
    return {name: f"http://127.0.0.1:{getattr(ports, name)}"
            for name in ("router", "scheduler", "accounting")}
