"""deploy/prometheus/rules: the alerts load, fire as their unit tests say, reach Prometheus in every
deployment (compose's prometheus.yml, the Kubernetes PrometheusRule) and each has a runbook line.

That every metric the rules use is exported by a running cluster is checked with the dashboard's
metrics in test_deploy.py (test_every_metric_on_the_dashboard_and_in_the_alerts_is_exported...).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.capability import require

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES_DIR = DEPLOY / "prometheus" / "rules"
RULES = RULES_DIR / "kvtier.rules.yml"
RULE_TESTS = RULES_DIR / "kvtier.rules.test.yml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
PROMETHEUS_RULE = DEPLOY / "kubernetes" / "base" / "prometheusrule.yaml"
METRIC = re.compile(r"\b((?:kvtier|process)_[a-z0-9_]+)\b")

# What the issue asks an alert for, and the alert that answers it.
REQUIRED = {
    "no leader": "KvtierNoLeader",
    "frequent leader changes": "KvtierFrequentLeaderChanges",
    "segment down": "KvtierSegmentDown",
    "segment expelled": "KvtierSegmentExpelled",
    "segment quarantined (issue 21)": "KvtierSegmentQuarantined",
    "DRAM nearly full": "KvtierDramNearlyFull",
    "sustained eviction": "KvtierSustainedEviction",
    "checksum mismatches": "KvtierChecksumMismatch",
    "SSD read errors": "KvtierSsdReadErrors",
    "fds near the limit": "KvtierFdsNearLimit",
    "master stuck recovering": "KvtierMasterStuckRecovering",
    "dropped without an SSD copy": "KvtierDroppedWithoutSsdCopy",
    "offload lag": "KvtierOffloadLag",
}


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def rule_metric_names() -> set[str]:
    """Every kvtier_* / process_* series name the alert expressions read."""
    return {name for rule in alert_rules() for name in METRIC.findall(rule["expr"])}


def promtool() -> str:
    path = shutil.which("promtool")
    require("promtool", path is not None, "apt-get install prometheus (.ci/run does)")
    return path


def test_promtool_check_rules_accepts_the_rules():
    result = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_promtool_rule_unit_tests_pass(tmp_path: Path):
    result = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name], cwd=RULES_DIR, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The same check must fail when an alert stops firing, or it proves nothing here.
    (tmp_path / RULES.name).write_text(RULES.read_text().replace("kvtier_segment_ssd_read_errors_total", "nothing"))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    broken = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert broken.returncode != 0 and "KvtierSsdReadErrors" in broken.stdout + broken.stderr


def test_every_required_condition_has_an_alert_with_severity_and_runbook_line():
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert set(REQUIRED.values()) <= set(rules), sorted(set(REQUIRED.values()) - set(rules))
    readme = (DEPLOY / "README.md").read_text()
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        anchor = name.lower()
        assert rule["annotations"]["runbook_url"] == f"deploy/README.md#{anchor}", name
        line = next((line for line in readme.splitlines() if f'<a id="{anchor}"></a>' in line), "")
        assert f"**{name}**" in line and len(line) > 80, f"deploy/README.md has no runbook line for {name}"


def test_prometheus_loads_the_rules_in_compose_and_its_config_is_valid(tmp_path: Path):
    config = yaml.safe_load(PROMETHEUS.read_text())
    (pattern,) = config["rule_files"]
    mounts = dict(v.split(":")[:2] for v in yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]["volumes"])
    assert mounts["../prometheus/rules"] == str(Path(pattern).parent), "compose mounts the rules where they are read"
    assert RULES.match(Path(pattern).name) and not RULE_TESTS.match(Path(pattern).name), pattern
    # promtool checks the config with its rule files; here they are read from the repository
    config["rule_files"] = [str(RULES_DIR / Path(pattern).name)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [promtool(), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout + result.stderr


def test_the_kubernetes_prometheusrule_carries_the_same_rules():
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    kustomization = yaml.safe_load((DEPLOY / "kubernetes" / "base" / "kustomization.yaml").read_text())
    assert PROMETHEUS_RULE.name in kustomization["resources"]
