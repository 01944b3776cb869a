"""What users read stands alone: no page, runbook, chart file, CRD description or code comment
sends them to a document the repository does not have, and every relative link in README.md and
docs/ reaches a file that exists (and, with an #anchor, one of its headings)."""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def tracked() -> list[pathlib.Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / n for n in names.splitlines() if (ROOT / n).is_file()]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_nothing_cites_a_design_document_that_is_not_in_the_repository():
    assert not (ROOT / "DESIGN.md").exists()
    citing = [str(p.relative_to(ROOT)) for p in tracked()
              if p.suffix in (".md", ".py", ".yaml", ".json", ".txt", ".tpl") and p.name != pathlib.Path(__file__).name
              and "DESIGN" in p.read_text(errors="replace")]
    assert citing == []


def test_every_relative_link_of_the_docs_reaches_a_file_and_heading():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, fragment = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif fragment and dest.suffix == ".md":
                headings = {anchor(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                if fragment not in headings:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []
