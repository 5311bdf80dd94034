"""Every relative link of the top-level Markdown files and docs/*.md resolves: the file exists
and, when the link names an anchor, the target file has a heading with that anchor (GitHub's
rule: lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")])
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE_RE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_RE = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """The text without fenced code blocks (their lines stay, empty, so numbers still match)."""
    return FENCE_RE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for no, line in enumerate(_prose(path.read_text()).splitlines(), 1):
        for m in LINK_RE.finditer(CODE_RE.sub("", line)):
            found.append((no, m.group(1)))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for no, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{page.name}:{no}: {target} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.name}:{no}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_slug_follows_github() -> None:
    assert slug("The demo: train, checkpoint, crash, resume, export") == (
        "the-demo-train-checkpoint-crash-resume-export")
    assert slug("Object stores (S3 API)") == "object-stores-s3-api"
    assert slug("Export at the demo's sizes") == "export-at-the-demos-sizes"
    assert slug("`async_save` stall") == "async_save-stall"
