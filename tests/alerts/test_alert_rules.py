"""The Prometheus rule group: valid for the real promtool, its unit tests pass (including the
cases that must not fire), and every alert documents itself and has a runbook in docs/."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "adpfleet" / "files" / "alert-rules.yaml"
RULE_TESTS = pathlib.Path(__file__).with_name("alert-rules.test.yaml")
RUNBOOK_PREFIX = "https://github.com/adpfleet/adpfleet/blob/main/"
REQUIRED_ALERTS = {"AdpfleetServerStalled", "AdpfleetRankStarving", "AdpfleetScrapeTargetDown",
                   "AdpfleetRemediationBudgetExhausted", "AdpfleetOperatorReconcileErrors"}


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: scripts/setup installs it (Debian package prometheus)"
    return path


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_accepts_the_rule_file():
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_pass():
    out = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_summary_description_and_an_existing_runbook():
    names = set()
    for rule in rules():
        names.add(rule["alert"])
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        url = annotations["runbook_url"]
        assert url.startswith(RUNBOOK_PREFIX), url
        runbook = ROOT / url[len(RUNBOOK_PREFIX):]
        assert runbook.is_file(), f"{rule['alert']}: {runbook} is missing"
        text = runbook.read_text()
        assert f"# {rule['alert']}" in text and "## Mitigation" in text
        assert rule["labels"]["severity"] in ("warning", "critical")
    assert REQUIRED_ALERTS <= names


def test_every_alert_is_covered_by_a_unit_test():
    tested = {case["alertname"] for t in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in t.get("alert_rule_test", []) if case.get("exp_alerts")}
    assert {r["alert"] for r in rules()} <= tested


def test_the_stall_alerts_keep_the_labels_the_operator_webhook_needs():
    from adpfleet.operator.alerts import ACTIONABLE

    for rule in rules():
        if rule["alert"] in ACTIONABLE:
            assert "sum by (namespace, fleet, pod" in rule["expr"], rule["alert"]


def test_the_end_to_end_copy_is_the_shipped_rule_group_with_only_the_stall_windows_shortened(tmp_path):
    from alert_windows import STALL_ALERTS, short_window_rules

    copy = tmp_path / "alert-rules.yaml"
    copy.write_text(short_window_rules(10, 2))
    out = subprocess.run([promtool(), "check", "rules", str(copy)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    short = [r for g in yaml.safe_load(copy.read_text())["groups"] for r in g["rules"]]
    for shipped, rule in zip(rules(), short, strict=True):
        if shipped["alert"] in STALL_ALERTS:
            assert rule["for"] == "2s" and "[10s]" in rule["expr"] and "offset 10s" in rule["expr"], rule
            rule = {**rule, "for": shipped["for"],
                    "expr": rule["expr"].replace("[10s", "[1m").replace("offset 10s", "offset 1m")}
        assert rule == shipped
