"""The alerting rules in ops/prometheus: each is well formed and says what to do, and
`promtool test rules` shows each fires on the series that should raise it and stays quiet
otherwise (promtool comes from ops/scripts/install-promtool.sh, which `make test` runs).
The Grafana dashboard in ops/grafana: each panel's queries are valid PromQL. That both read
metrics the services serve is checked here against the services' apps built in-process, and
against the running stack in tests/integration/test_metrics.py."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from monitoring_files import DASHBOARD, RULE_TESTS, RULES, RULES_DIR, dashboard_queries, rules

from gpusched_ops.stack import default_cache_dir


def test_every_alert_has_a_severity_and_says_what_to_do() -> None:
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names)) >= 7
    for rule in rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_every_alert_is_tested_firing() -> None:
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {check["alertname"] for case in cases for check in case["alert_rule_test"]
             if check["exp_alerts"]}
    assert fired == {rule["alert"] for rule in rules()}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = default_cache_dir() / "bin" / "promtool"
    if found.is_file():
        return str(found)
    on_path = shutil.which("promtool")
    if on_path is None:
        pytest.skip(f"promtool is not in {found.parent} or on PATH; run "
                    "ops/scripts/install-promtool.sh")
    return on_path


@pytest.mark.parametrize("command,path", [("check", RULES), ("test", RULE_TESTS)])
def test_promtool_accepts_the_rules_and_their_tests_pass(promtool: str, command: str,
                                                         path: Path) -> None:
    done = subprocess.run([promtool, command, "rules", str(path)], capture_output=True,
                          text=True, timeout=120, cwd=RULES_DIR)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_dashboard_panel_is_placed_described_and_reads_the_chosen_prometheus() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    [variable] = dashboard["templating"]["list"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 10
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["description"] and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_promtool_accepts_every_dashboard_query(promtool: str, tmp_path: Path) -> None:
    """As recording rules, since promtool checks expressions in rule files only."""
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{n}", "expr": expr}
        for n, expr in enumerate(dashboard_queries())]}]}
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@functools.cache
def _served_metrics() -> dict[str, str]:
    """What /metrics of each service serves at start, by service (an agent by executor; the
    torch one where PyTorch is installed), their apps built in-process (Redis and Kafka
    unreachable: nothing is started)."""
    import asyncio
    import importlib.util

    import httpx

    from gpusched_accounting.main import create_app as accounting
    from gpusched_accounting.settings import AccountingSettings
    from gpusched_agent.main import create_app as agent
    from gpusched_agent.settings import AgentSettings
    from gpusched_common.settings import RedisSettings, TelemetrySettings
    from gpusched_router.main import create_app as router
    from gpusched_router.settings import RouterSettings
    from gpusched_scheduler.main import create_app as scheduler
    from gpusched_scheduler.settings import SchedulerSettings

    common = {"telemetry": TelemetrySettings(otlp_endpoint=""),
              "redis": RedisSettings(url="redis://127.0.0.1:1/0")}
    node = {**common, "simulate": "1xH100-80GB"}
    apps = {"router": router(RouterSettings(**common)),
            "scheduler": scheduler(SchedulerSettings(**common)),
            "accounting": accounting(AccountingSettings(**common)),
            "agent simulated": agent(AgentSettings(**node, node_id="n")),
            "agent openai": agent(AgentSettings(**node, node_id="e", executor="openai",
                                                openai_base_url="http://127.0.0.1:1"))}
    if importlib.util.find_spec("torch") is not None:
        apps["agent torch"] = agent(AgentSettings(**node, node_id="t", executor="torch",
                                                  torch_device="cpu"))

    async def scrape() -> dict[str, str]:
        texts = {}
        for name, app in apps.items():
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
                texts[name] = (await http.get("/metrics")).text
        return texts

    return asyncio.run(scrape())


def _served_series(text: str) -> set[tuple[str, frozenset]]:
    """(sample name, labels) of every gpusched series `text` serves."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, frozenset(sample.labels.items()))
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith("gpusched_")}


def test_every_metric_the_rules_and_the_dashboard_read_is_declared() -> None:
    """A name misspelt in a rule reads nothing and never fires. Every gpusched metric is
    declared (its HELP served) as its service starts, labelled series or not; the running
    stack's check is tests/integration/test_metrics.py."""
    import re

    texts = _served_metrics()
    declared = {name for text in texts.values()
                for name in re.findall(r"^# HELP (gpusched_\w+)", text, re.MULTILINE)}
    queries = [rule["expr"] for rule in rules()] + dashboard_queries()
    read = {name for expr in queries for name in re.findall(r"\bgpusched_\w+", expr)}
    assert {name for name in read if name not in declared
            and re.sub(r"_(bucket|count|sum)$", "", name) not in declared} == set()
    # the lag is every service's name: each service a query reads it of measures its own
    lagging = {service for expr in queries for service in re.findall(
        r'gpusched_consumer_lag_records\{service="([\w-]+)"', expr)}
    assert lagging == {"scheduler", "accounting", "gpu-agent", "router"}
    agents = [name for name in texts if name.startswith("agent ")]
    for service in lagging:
        for app in agents if service == "gpu-agent" else [service]:
            assert "# HELP gpusched_consumer_lag_records " in texts[app], app


def test_every_agent_serves_the_refusals_its_executor_can_make_at_zero_from_the_start(
        ) -> None:
    """Only an openai agent served its refusal counts before a first refusal, though the
    torch executor refuses requests beyond its model's positions too (a 400): a torch node's
    first refusal was a series first seen at 1, no increase() to alert on."""
    refusing = {"agent simulated": (), "agent openai": ("400", "413", "422"),
                "agent torch": ("400",)}
    served = _served_metrics()
    if "agent torch" not in served:
        pytest.skip("the torch extra: pip install 'gpusched-agent[torch]'")
    for agent, text in served.items():
        if agent not in refusing:
            continue
        series = [dict(labels) | {"name": name} for name, labels in _served_series(text)]
        models = {s["model"] for s in series if s["name"] == "gpusched_agent_load_failures_total"}
        refusals = {(s["model"], s["status"]) for s in series
                    if s["name"] == "gpusched_agent_engine_refusals_total"}
        assert models, agent
        assert refusals == {(model, status) for model in models
                            for status in refusing[agent]}, agent


def test_every_series_an_alert_waits_to_rise_is_served_at_zero_from_the_start() -> None:
    """increase() sees no rise in a series that first appears at 1: a labelled counter is
    served only once its labels are first used, so a first unschedulable request or a first
    dead-lettered record raised no alert (promtool's cases start their series at 0, as the
    services did not). Each series an alert names, by name and by the label values it
    matches, is served from the start."""
    import re

    served = set().union(*map(_served_series, _served_metrics().values()))
    for rule in rules():
        # the series counted with increase(): one rise, a first event, is what they await
        for name, selector in re.findall(r"increase\((gpusched_[a-z_]+)(\{[^}]*\})?\[",
                                         rule["expr"]):
            wanted = [(key, values.split("|")) for key, op, values in re.findall(
                r'(\w+)\s*(=~|=)\s*"([^"]*)"', selector) if re.fullmatch(r"[\w|]+", values)]
            for key, values in wanted:
                for value in values:
                    assert any(n == name and (key, value) in labels for n, labels in served), \
                        (rule["alert"], name, key, value)
            assert any(n == name for n, _ in served), (rule["alert"], name)
