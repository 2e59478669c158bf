"""Every relative link in README.md and docs/*.md points to a file that exists and, where it names an anchor, to a
heading in that file: the docs are split over several files, and a moved section must not leave a dead link behind."""

import re
from pathlib import Path

import pytest

from helpers import DOCUMENTS, REPO_ROOT as ROOT, prose_lines

# [text](target) and ![alt](target); the target ends at the first space (an optional title follows) or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link in a heading keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; repeated headings get -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def relative_links(path: Path):
    for line in prose_lines(path):
        for target in LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):   # not http:, https:, mailto: ...
                yield target


def test_the_documents_are_found():
    names = {path.name for path in DOCUMENTS}
    assert {"README.md", "RESULTS.md"} <= names


def test_slugs_follow_github():
    assert slug("Serve with vLLM") == "serve-with-vllm"
    assert slug("Drafts without distributions, and verify calls (2026-11-25, third stop)") == \
        "drafts-without-distributions-and-verify-calls-2026-11-25-third-stop"
    assert slug("Security: the code sandbox") == "security-the-code-sandbox"
    assert slug("`dx.verify` and *friends*") == "dxverify-and-friends"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(document):
    broken = []
    for target in relative_links(document):
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {linked.name}")
    assert not broken, f"{document.name}: " + "; ".join(broken)
