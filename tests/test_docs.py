"""The README's and docs' links inside the repository lead somewhere: each linked file exists and each
`#anchor` is the GitHub anchor of one of its headings (docs/benchmarks.md's dated section names are long,
and a link written from memory once pointed nowhere)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\]\(([^)\s]*)\)")
_HEADING = re.compile(r"^#+ (.*)$", re.M)
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than '-' and '_' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(h) for h in _HEADING.findall(_FENCE.sub("", path.read_text()))}


def broken_links(files: list[Path]) -> list[str]:
    """'file: link' for each in-repository link whose file or anchor does not exist."""
    broken = []
    for path in files:
        for link in _LINK.findall(_FENCE.sub("", path.read_text())):
            if re.match(r"[a-z]+:", link):  # http(s), mailto: not ours to check
                continue
            target, _, anchor = link.partition("#")
            target_path = (path.parent / target).resolve() if target else path
            if not target_path.exists() or (
                anchor and target_path.suffix == ".md" and anchor not in _anchors(target_path)
            ):
                broken.append(f"{path.name}: {link}")
    return broken


def test_readme_and_docs_links_lead_somewhere() -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert broken_links(files) == []


def test_checker_finds_a_planted_broken_link(tmp_path) -> None:
    (tmp_path / "other.md").write_text("# A section, dated (2026-12-06)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-section-dated-2026-12-06) [no anchor](other.md#a-section) [no file](gone.md)\n"
        "[web](https://example.com/#x)\n```\n[in a code block](nowhere.md)\n```\n"
    )
    assert broken_links([page]) == ["page.md: other.md#a-section", "page.md: gone.md"]
