"""The monitoring files in ops/ (the alerting rules and the Grafana dashboard) as objects for a
Kubernetes cluster run with the Prometheus Operator (kube-prometheus-stack, for example): a
PodMonitor that scrapes every gpusched service, a PrometheusRule holding the rules, and a
ConfigMap that Grafana's dashboard sidecar loads. Made from the files themselves, so the
cluster gets the rules and dashboard the test suite checks, never a copy that drifts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

SERVICES = ("router", "scheduler", "accounting", "gpu-agent")
"""The `app.kubernetes.io/name` of the pods that serve /metrics on their port `http`."""
PART_OF_LABEL = {"app.kubernetes.io/part-of": "gpusched"}
"""The label of every gpusched pod, which the PodMonitor selects them by; every object here
carries it too."""
DASHBOARD_LABEL = {"grafana_dashboard": "1"}
"""The label Grafana's sidecar (kube-prometheus-stack's default) loads dashboards by."""
OWN_LABELS = {**PART_OF_LABEL, **DASHBOARD_LABEL}
"""The labels these objects set themselves: a label of the caller's under one of these keys
would replace one (or be replaced), so it is not taken."""


def rules_file(repo_root: Path) -> Path:
    return repo_root / "ops" / "prometheus" / "gpusched-rules.yaml"


def dashboard_file(repo_root: Path) -> Path:
    return repo_root / "ops" / "grafana" / "gpusched.json"


def operator_objects(repo_root: Path, namespace: str = "gpusched",
                     labels: dict[str, str] | None = None,
                     dashboard_namespace: str | None = None) -> list[dict[str, Any]]:
    """The PodMonitor and PrometheusRule in `namespace`, and the dashboard's ConfigMap in
    `dashboard_namespace` (default: the same), each with `labels` too (a Prometheus that
    selects its monitors and rules by label, such as kube-prometheus-stack's
    `release: <name>`, needs them), none of them under a key of OWN_LABELS."""

    def metadata(name: str, extra: dict[str, str] | None = None,
                 where: str | None = None) -> dict[str, Any]:
        return {"name": name, "namespace": where or namespace, "labels": {
            **PART_OF_LABEL, **(labels or {}), **(extra or {})}}

    rules = yaml.safe_load(rules_file(repo_root).read_text())
    dashboard = dashboard_file(repo_root).read_text()
    json.loads(dashboard)  # a broken file fails here, not in Grafana
    return [
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
         "metadata": metadata("gpusched"),
         "spec": {"selector": {
             "matchLabels": dict(PART_OF_LABEL),
             "matchExpressions": [{"key": "app.kubernetes.io/name", "operator": "In",
                                   "values": list(SERVICES)}]},
             "podMetricsEndpoints": [{"port": "http", "path": "/metrics"}]}},
        {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
         "metadata": metadata("gpusched"), "spec": {"groups": rules["groups"]}},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": metadata("gpusched-dashboard", DASHBOARD_LABEL, dashboard_namespace),
         "data": {"gpusched.json": dashboard}},
    ]


class _Dumper(yaml.SafeDumper):
    """Writes text of several lines (the dashboard, a rule's description) as a block, as a
    person would, not as one escaped string."""


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def operator_manifests(objects: list[dict[str, Any]]) -> str:
    """`objects` as one YAML stream for `kubectl apply -f -`."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=100)
