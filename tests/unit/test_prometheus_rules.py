"""Prometheus's own checker on the rules and the dashboard's queries (issue 31): ``promtool check
rules`` passes on ``deploy/prometheus/alerts.yml``, ``promtool test rules`` proves each alert
fires on the case it is for (``alerts.test.yml``), and every dashboard query parses.

promtool is built at a pinned version by ``tools/install-tools.sh promtool`` (``make tools``,
which CI runs first). Where it is missing the tests skip, saying so, except under CI=true.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.test_metric_catalogue import ALERTS, ROOT, all_panels, dashboard

RULES_TESTS = ALERTS.with_name("alerts.test.yml")


@pytest.fixture(scope="module")
def promtool() -> str:
    """The promtool to run: $PROMTOOL, the pinned build in .tools/bin, or one on the PATH."""
    built = ROOT / ".tools" / "bin" / "promtool"
    found = os.environ.get("PROMTOOL") or (str(built) if built.exists() else None)
    found = found or shutil.which("promtool")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must have promtool (.ci/run builds it: make tools)")
        pytest.skip("promtool is not built: make tools (tools/install-tools.sh promtool)")
    print(f"\npromtool: {found}")
    return found


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    print(run.stdout, run.stderr)
    return run


def test_promtool_check_rules_passes(promtool: str) -> None:
    run = _run(promtool, "check", "rules", ALERTS)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout + run.stderr


def test_promtool_rules_unit_tests_pass(promtool: str) -> None:
    run = _run(promtool, "test", "rules", RULES_TESTS)
    assert run.returncode == 0, run.stdout + run.stderr


def test_promtool_refuses_a_broken_rule(promtool: str, tmp_path: Path) -> None:
    # The check can fail: a misspelt function and a bad duration are both refused.
    for expr, duration in (("rat(epd_api_requests_total[5m]) > 0", "5m"), ("up", "5 minutes")):
        bad = tmp_path / "bad.yml"
        rule = {"alert": "Broken", "expr": expr, "for": duration}
        bad.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [rule]}]}))
        assert _run(promtool, "check", "rules", bad).returncode != 0


def test_a_rules_test_expecting_what_does_not_happen_fails(promtool: str, tmp_path: Path) -> None:
    # The unit tests can fail: every required stage has a worker, yet the case expects the
    # no-workers alert.
    series = [
        {"series": f'epd_fleet_workers{{stage="{stage}"}}', "values": "1x10"}
        for stage in ("router", "encode", "prefill", "results")
    ]
    expect = {"exp_labels": {"severity": "critical", "stage": "encode"}}
    case = {
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "EpdStageWithoutWorkers", "exp_alerts": [expect]}
        ],
    }
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    wrong = tmp_path / "wrong.test.yml"
    wrong.write_text(yaml.safe_dump({"rule_files": [ALERTS.name], "tests": [case]}))
    run = _run(promtool, "test", "rules", wrong)
    assert run.returncode != 0 and "EpdStageWithoutWorkers" in run.stdout + run.stderr


def test_every_dashboard_query_parses(promtool: str, tmp_path: Path) -> None:
    # Each panel's query as a recording rule, Grafana's interval variable replaced by a
    # duration, so Prometheus's parser reads what Grafana would send.
    rules = []
    for panel in all_panels(dashboard()["panels"]):
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "5m")
            name = f"dashboard:panel{panel['id']}:{target['refId']}"
            rules.append({"record": name, "expr": expr})
    assert len(rules) > 15
    queries = tmp_path / "dashboard-queries.yml"
    queries.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = _run(promtool, "check", "rules", queries)
    assert run.returncode == 0, run.stdout + run.stderr
