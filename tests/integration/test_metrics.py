"""The alerting rules in ops/prometheus and the Grafana dashboard in ops/grafana read only
metrics the running services serve (the rules' behaviour is tested with promtool, and the
dashboard's queries checked by it, in tests/unit/test_monitoring.py)."""

from __future__ import annotations

import re

import httpx
import pytest
from monitoring_files import dashboard_queries, rules
from stack_helpers import TEST_SERVICE_PORTS

pytestmark = pytest.mark.asyncio(loop_scope="session")


def rule_queries() -> list[str]:
    return [rule["expr"] for rule in rules()]


@pytest.mark.parametrize("what,queries,least", [
    ("the alert rules", rule_queries, 8), ("the dashboard", dashboard_queries, 14)])
async def test_every_metric_read_is_served(stack, what: str, queries, least: int) -> None:
    served: set[str] = set()
    async with httpx.AsyncClient(timeout=10) as http:
        for url in (stack.router_url, stack.scheduler_url, stack.accounting_url,
                    f"http://127.0.0.1:{TEST_SERVICE_PORTS.agent(0)}"):
            text = (await http.get(f"{url}/metrics")).text
            served |= set(re.findall(r"^# HELP (\S+)", text, re.MULTILINE))
    read = {name for expr in queries() for name in re.findall(r"\bgpusched_\w+", expr)}

    assert len(read) >= least
    missing = {name for name in read
               if name not in served and re.sub(r"_(bucket|count|sum)$", "", name) not in served}
    assert not missing, f"{what} read metrics no service serves: {sorted(missing)}"


async def test_every_read_of_every_service_answers_head_as_get(stack) -> None:
    """The scheduler's /v1/cluster, /v1/placements, /v1/queue and the agent's /v1/node
    answered HEAD with 405, which load balancers and probes send, though every other read
    answers it."""
    agent = f"http://127.0.0.1:{TEST_SERVICE_PORTS.agent(0)}"
    reads = [f"{stack.scheduler_url}/v1/{path}" for path in ("cluster", "placements", "queue")]
    reads += [f"{agent}/v1/node", f"{agent}/healthz", f"{stack.router_url}/v1/models"]
    async with httpx.AsyncClient(timeout=10) as http:
        for url in reads:
            got, head = await http.get(url), await http.head(url)
            assert (head.status_code, head.content) == (got.status_code, b""), url
            assert got.status_code == 200, url
