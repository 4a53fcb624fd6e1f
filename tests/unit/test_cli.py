"""The `gpusched` command's tables stay whole where output is piped: a CI log or a file gets
an 80-column console, and a model name cut to "llama-3.…" is no use there."""

from __future__ import annotations

from pathlib import Path

import yaml
from rich.console import Console

from gpusched_ops.cli import usage_table

MODELS = Path(__file__).resolve().parents[2] / "config" / "models.yaml"


def _row(requests: int) -> dict:
    return {"requests": requests, "prompt_tokens": 139_800, "completion_tokens": 21_600,
            "gpu_seconds": 4.281, "cost_usd": 0.0097}


def test_usage_table_keeps_every_name_and_header_whole_at_80_columns() -> None:
    models = [m["name"] for m in yaml.safe_load(MODELS.read_text())["models"]]
    data = {"group_by": "model", "start_ms": 1_764_700_000_000, "end_ms": 1_764_700_060_000,
            "tenants": [{"tenant": tenant, "totals": _row(120),
                         "groups": [{"group": m, **_row(30)} for m in models]}
                        for tenant in ("acme", "globex", "initech")]}
    console = Console(width=80, record=True)
    console.print(usage_table(data))
    text = console.export_text()

    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    for word in (*models, "globex", "initech", "completion", "seconds", "139800", "0.0097"):
        assert word in text, word
