"""The documentation's relative links resolve: README, BENCHMARKS and every ``docs/*.md``.

A link ``[text](path#anchor)`` must name an existing file, and an anchor must name a heading
of that file (GitHub's slug: lower case, punctuation dropped, spaces to hyphens). Links
inside fenced code blocks and absolute URLs are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"```.*?```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").replace("*", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            slug = _slug(match.group(1))
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _broken_links() -> list[str]:
    broken: list[str] = []
    for page in _pages():
        for link in LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            name = page.relative_to(ROOT)
            if not target.exists():
                broken.append(f"{name}: no file {link}")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{name}: no heading for {link}")
    return broken


def test_every_relative_link_resolves() -> None:
    assert _broken_links() == []


def test_readme_stays_short() -> None:
    # The README is the ten-minute read; details live in docs/.
    assert len((ROOT / "README.md").read_text(encoding="utf-8")) < 12_000
