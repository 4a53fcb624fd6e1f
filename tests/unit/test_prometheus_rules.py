"""The alerting rules in ops/prometheus: each is well formed and says what to do, and
`promtool test rules` shows each fires on the series that should raise it and stays quiet
otherwise (promtool comes from ops/scripts/install-promtool.sh, which `make test` runs).
That the rules read metrics the services serve is checked against the running stack in
tests/integration/test_metrics.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gpusched_ops.stack import default_cache_dir

RULES_DIR = Path(__file__).resolve().parents[2] / "ops" / "prometheus"
RULES = RULES_DIR / "gpusched-rules.yaml"
RULE_TESTS = RULES_DIR / "gpusched-rules.test.yaml"


def rules() -> list[dict]:
    [group] = yaml.safe_load(RULES.read_text())["groups"]
    return group["rules"]


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
