"""The alerting rules in ops/prometheus read only metrics the running services serve (the
rules' own behaviour is tested with promtool in tests/unit/test_prometheus_rules.py)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import yaml
from stack_helpers import TEST_SERVICE_PORTS

pytestmark = pytest.mark.asyncio(loop_scope="session")
RULES = Path(__file__).resolve().parents[2] / "ops" / "prometheus" / "gpusched-rules.yaml"


async def test_every_metric_the_alert_rules_read_is_served(stack) -> None:
    served: set[str] = set()
    async with httpx.AsyncClient(timeout=10) as http:
        for url in (stack.router_url, stack.scheduler_url, stack.accounting_url,
                    f"http://127.0.0.1:{TEST_SERVICE_PORTS.agent(0)}"):
            text = (await http.get(f"{url}/metrics")).text
            served |= set(re.findall(r"^# HELP (\S+)", text, re.MULTILINE))
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    read = {name for rule in rules for name in re.findall(r"\bgpusched_\w+", rule["expr"])}

    assert len(read) >= 8
    missing = {name for name in read
               if name not in served and re.sub(r"_(bucket|count|sum)$", "", name) not in served}
    assert not missing, f"the rules read metrics no service serves: {sorted(missing)}"
