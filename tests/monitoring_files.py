"""The monitoring files in ops/ as tests read them: the Prometheus alerting rules and their
promtool tests, and the Grafana dashboard's queries."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from gpusched_ops.monitoring import dashboard_file, rules_file

REPO_ROOT = Path(__file__).resolve().parents[1]
RULES = rules_file(REPO_ROOT)
RULES_DIR = RULES.parent
RULE_TESTS = RULES_DIR / "gpusched-rules.test.yaml"
DASHBOARD = dashboard_file(REPO_ROOT)
GRAFANA_VARIABLES = {"$__rate_interval": "5m"}
"""What Grafana puts in a query before Prometheus sees it."""


def rules() -> list[dict]:
    """Every rule of every group."""
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    """Each query of the dashboard, as Prometheus gets it."""
    queries = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", ()):
            expr = target["expr"]
            for name, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(name, value)
            queries.append(expr)
    return queries
