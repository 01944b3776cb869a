"""Every command block in docs/ is run by a test, or says on the page why none can run it.

The blocks that run against the local cluster run in tests/chart/test_install.py (the chart's
release `adpfleet`, installed by install.md's own Quickstart) and tests/operator/test_stall_e2e.py;
those that need no cluster run here.
"""

from __future__ import annotations

import re

import doc_commands
from doc_commands import DOCS, ROOT

PAGES = sorted(DOCS.glob("*.md")) + sorted((DOCS / "runbooks").glob("*.md"))

# (page, `## ` section) -> the tests that run its command blocks
RUN_BY = {
    ("install.md", "Quickstart"): "test_install_runs_the_operator_under_its_service_account_and_it_reconciles_a_fleet",
    ("install.md", "Pointing a fleet at its weights"): "test_install_md_commands_read_the_release_as_documented",
    ("install.md", "Values"): "test_install_md_commands_read_the_release_as_documented",
    ("install.md", "Upgrading the CRD"): "test_install_md_upgrades_the_crd_and_the_release_and_turns_monitoring_on",
    ("install.md", "Uninstalling"): "test_deleting_the_fleet_then_uninstalling_leaves_nothing_behind",
    ("install.md", "Prometheus and Alertmanager"): (
        "test_install_md_upgrades_the_crd_and_the_release_and_turns_monitoring_on",
        "test_install_md_commands_read_the_release_as_documented"),
    ("operator.md", ""): "test_operator_md_commands_start_an_operator_and_a_standby_of_the_release",
    ("operator.md", "Running it"): "test_operator_md_commands_start_an_operator_and_a_standby_of_the_release",
    ("operator.md", "Changing the resource"): "test_operator_md_regenerates_the_committed_crd_and_reference",
    ("autoscaling.md", "The scale target: an InferenceFleetRole per role"):
        "test_autoscaling_md_scales_a_role_as_documented",
    ("remediation.md", "Rehearsing a stall (fault injection)"): "inject_as_documented",
}
RUNBOOKS_RUN_BY = "test_every_runbook_command_runs_against_the_release"
VLLM_RUNBOOKS_RUN_BY = "test_a_frozen_vllm_engine_is_hung_and_only_its_server_is_replaced_with_no_request_lost"


def _defined(name: str) -> bool:
    return any(re.search(rf"^def {name}\(", p.read_text(), re.M) for p in (ROOT / "tests").rglob("*.py"))


def test_every_command_block_of_the_docs_is_run_by_a_test_or_says_why_not():
    unrun, reasons = [], []
    for page in PAGES:
        for block in doc_commands.blocks(page):
            if block.not_run:
                reasons.append(block.not_run)
                continue
            runner = RUN_BY.get((page.name, block.section))
            if page.parent.name == "runbooks":
                runner = VLLM_RUNBOOKS_RUN_BY if page.stem.endswith("-vllm") else RUNBOOKS_RUN_BY
            if runner is None or not all(_defined(name) for name in ([runner] if isinstance(runner, str) else runner)):
                unrun.append(f"{block} (runner: {runner})")
    assert not unrun, "command blocks no test runs (run them, or mark them `<!-- not run by tests: why -->`):\n" + \
        "\n".join(unrun)
    assert all(len(reason.split()) >= 4 for reason in reasons), reasons  # a reason, not a shrug


def test_the_extractor_reads_commands_as_a_shell_would():
    commands = doc_commands.bash_commands(
        "a --x 1 \\\n  --y '#not a comment'   # a comment\n# only a comment\n\n"
        "kubectl apply -f - <<'YAML'\nkind: X   # kept\nYAML\nb\n")
    assert commands == ["a --x 1    --y '#not a comment'", "kubectl apply -f - <<'YAML'\nkind: X   # kept\nYAML", "b"]


def test_operator_md_regenerates_the_committed_crd_and_reference(tmp_path):
    """The page's three commands, run in a copy of the tree's layout, write exactly the committed
    files (tests/operator/test_crd.py checks those against the models)."""
    block, = doc_commands.blocks(DOCS / "operator.md", "Changing the resource")
    written = [re.search(r"(?:> |cp \S+ )(\S+)$", c).group(1) for c in block.commands]
    for target in written:  # a target ending in / is a directory
        (tmp_path / target if target.endswith("/") else (tmp_path / target).parent).mkdir(parents=True, exist_ok=True)
    doc_commands.run(block.commands, doc_commands.Place("unused"), cwd=tmp_path, timeout=120)
    for target in written:
        path = tmp_path / target / "inferencefleets.adpfleet.io.yaml" if target.endswith("/") else tmp_path / target
        committed = ROOT / path.relative_to(tmp_path)
        assert path.read_text() == committed.read_text(), f"{block.commands}: {committed.name} is not the committed one"
