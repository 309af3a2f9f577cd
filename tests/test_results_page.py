"""docs/results.md points at what exists: every link into docs/benchmarks.md names one of
its headings (GitHub's anchors), every image is a committed PNG, every committed PNG is
shown."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation but hyphens and spaces
    dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_anchor_rule_on_headings_like_these() -> None:
    assert github_anchor("Offload's rate vs admission's (issue 36)") == "offloads-rate-vs-admissions-issue-36"
    assert github_anchor("Many SLOs: a mixed chat + batch workload (DES)") == "many-slos-a-mixed-chat--batch-workload-des"
    assert github_anchor("Prefill/decode pairs (DES, issue 38)") == "prefilldecode-pairs-des-issue-38"


def test_links_into_benchmarks_name_its_headings() -> None:
    headings = [line.lstrip("#").strip() for line in (DOCS / "benchmarks.md").read_text().splitlines()
                if line.startswith("#")]
    anchors = {github_anchor(h) for h in headings}
    links = re.findall(r"\(benchmarks\.md#([^)]+)\)", (DOCS / "results.md").read_text())
    assert links, "results.md links no section of benchmarks.md"
    assert sorted(set(links) - anchors) == []


def test_every_image_is_committed_and_every_committed_image_shown() -> None:
    shown = set(re.findall(r"\]\((img/[^)]+\.png)\)", (DOCS / "results.md").read_text()))
    committed = {f"img/{p.name}" for p in (DOCS / "img").glob("*.png")}
    assert shown == committed
