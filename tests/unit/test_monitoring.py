"""The alerting rules in ops/prometheus: each is well formed and says what to do, and
`promtool test rules` shows each fires on the series that should raise it and stays quiet
otherwise (promtool comes from ops/scripts/install-promtool.sh, which `make test` runs).
The Grafana dashboard in ops/grafana: each panel's queries are valid PromQL. That both read
metrics the services serve is checked against the running stack in
tests/integration/test_metrics.py."""

from __future__ import annotations

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
