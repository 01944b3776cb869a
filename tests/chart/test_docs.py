"""The configuration snippets in docs/install.md are accepted by the real amtool and promtool."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

import doc_commands
from helm_chart import CHART, ROOT

DOC = ROOT / "docs" / "install.md"


def checked_snippet(tool: str) -> str:
    """The fenced block right after `<!-- checked by ... with <tool> ... -->`."""
    match = re.search(rf"<!-- checked by tests/chart/test_docs.py with {tool}[^>]*-->\s*```yaml\n(.*?)```",
                      DOC.read_text(), re.S)
    assert match, f"docs/install.md has no snippet checked with {tool}"
    return match.group(1)


def run(tool: str, *args: str) -> subprocess.CompletedProcess:
    path = shutil.which(tool)
    assert path, f"{tool} is missing: scripts/setup installs it (Debian packages prometheus, prometheus-alertmanager)"
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60)


def test_the_alertmanager_receiver_snippet_is_a_valid_configuration(tmp_path):
    config = tmp_path / "alertmanager.yml"
    config.write_text(checked_snippet("amtool check-config"))
    out = run("amtool", "check-config", str(config))
    assert out.returncode == 0, out.stdout + out.stderr
    # it routes exactly the alerts the operator acts on, to the chart's Service and token Secret
    from adpfleet.operator.alerts import ACTIONABLE
    text = config.read_text()
    assert "|".join(ACTIONABLE) in text
    assert "http://adpfleet.adpfleet-system.svc:8080/alerts" in text and "adpfleet-webhook/token" in text


@pytest.mark.parametrize("tool", ["promtool check config"])
def test_the_prometheus_scrape_snippet_is_a_valid_configuration_with_the_rule_file(tmp_path, tool):
    snippet = checked_snippet(tool).replace("/etc/prometheus/rules/adpfleet.yaml",
                                           str(CHART / "files" / "alert-rules.yaml"))
    # Debian's promtool is built without Kubernetes service discovery; everything else (the
    # relabelings, the rule file) it checks as written
    assert snippet.count("kubernetes_sd_configs:\n      - role: pod\n") == 2
    snippet = snippet.replace("kubernetes_sd_configs:\n      - role: pod\n",
                              "static_configs:\n      - targets: [127.0.0.1:8000]\n")
    config = tmp_path / "prometheus.yml"
    config.write_text(snippet)
    out = run("promtool", "check", "config", str(config))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout and "rules found" in out.stdout, out.stdout


def quickstart_commands(page) -> str:
    """The commands of a page's Quickstart section (`## Quickstart...`)."""
    found = [b for b in doc_commands.blocks(page) if b.section.startswith("Quickstart")]
    assert found, f"{page.name} has no Quickstart section with commands"
    return "\n".join(c for block in found for c in block.commands)


def test_the_quickstarts_tell_one_namespace_story():
    """README.md and docs/install.md: the operator and the fleet in one namespace, created before
    anything goes in it; nothing is applied to a namespace no command created."""
    for page in (ROOT / "README.md", DOC):
        commands = quickstart_commands(page)
        used = set(re.findall(r"(?:-n|--namespace)[ =]([a-z0-9-]+)", commands))
        assert used == {"adpfleet-system"}, (page.name, used)
        assert "--create-namespace" in commands or "kubectl create namespace adpfleet-system" in commands, page.name
        assert "--set 'watch.namespaces" not in commands, page.name  # a watched namespace it never creates
