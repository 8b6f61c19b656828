"""Unit tests of the docs: the field reference equals the models, and no reference dangles.

A relative link in the README, docs/ or bench/README.md must name a file that exists, and its
anchor a heading of that file; a `docs/PAGE.md` named in code or an example must exist too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rljob_operator.specdoc import SPEC_DOC_PATH, spec_doc

ROOT = Path(__file__).parents[2]

PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "bench" / "README.md",
        ROOT / "charts" / "rljob" / "README.md",
        *(ROOT / "docs").glob("*.md"),
    ]
)

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans removed."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(_INLINE_CODE.sub("", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lowercase, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a markdown file's headings; a repeated heading gets -1, -2, ..."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def dangling_links(page: Path) -> list[str]:
    """The relative links of one page whose file or anchor does not exist."""
    bad = []
    for number, line in enumerate(_prose_lines(page.read_text()), start=1):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (page.parent / file_part).resolve() if file_part else page
            if not linked.exists():
                bad.append(f"line ~{number}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                bad.append(f"line ~{number}: {target} (no heading #{anchor} in {linked.name})")
    return bad


def test_slug_follows_github_on_code_punctuation_and_links() -> None:
    assert slug("What `make run` does") == "what-make-run-does"
    assert slug("spec.volumes[].configMap") == "specvolumesconfigmap"
    assert slug("Admission, failures and the startup deadline") == (
        "admission-failures-and-the-startup-deadline"
    )
    assert slug("See [the plan](memory-plan.md)") == "see-the-plan"


def test_dangling_links_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# Title\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-section) [gone](nowhere.md) [bad anchor](there.md#no-section)\n"
        "[self](#local) `[in code](nowhere.md)` [web](https://example.com/x.md)\n"
        "```\n[fenced](nowhere.md)\n```\n## Local\n"
    )
    assert dangling_links(page) == [
        "line ~1: nowhere.md (no such file)",
        "line ~1: there.md#no-section (no heading #no-section in there.md)",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings_that_exist(page: Path) -> None:
    assert page.exists(), f"{page.relative_to(ROOT)} is expected to exist"
    assert dangling_links(page) == [], f"{page.relative_to(ROOT)} has dangling links"


def test_docs_pages_named_in_code_and_examples_exist() -> None:
    named = re.compile(r"\bdocs/([a-z0-9_-]+\.md)")
    missing = []
    for folder in ("rljob", "operator", "worker_image", "bench", "hack", "examples", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in {".py", ".sh", ".yaml", ".yml"} or not path.is_file():
                continue
            for page in named.findall(path.read_text(errors="replace")):
                if not (ROOT / "docs" / page).exists():
                    missing.append(f"{path.relative_to(ROOT)}: docs/{page}")
    assert missing == []


def test_checked_in_spec_reference_equals_generated_from_models() -> None:
    checked_in = (ROOT / SPEC_DOC_PATH).read_text()
    assert checked_in == spec_doc(), (
        f"{SPEC_DOC_PATH} drifted from rljob/api/; regenerate with "
        f"`rljob spec-doc --out {SPEC_DOC_PATH}` (or `make crd`)"
    )


def test_every_spec_field_in_the_reference_has_a_description() -> None:
    rows = [line for line in spec_doc().splitlines() if line.startswith("| `spec")]
    cells = [re.split(r"(?<!\\)\|", row) for row in rows]  # an escaped \| stays in its cell
    undescribed = [row[1].strip() for row in cells if not row[-2].strip()]
    assert len(rows) > 100  # every field, nested ones included
    assert undescribed == []
