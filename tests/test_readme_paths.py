"""The README and docs/ point only inside the repository: every relative link reaches a file (and a heading)
that exists, and the example files their commands use are shipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), not images; the text may wrap


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def prose(text: str) -> str:
    """The text outside fenced code blocks (a link inside one is code, not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def code(text: str) -> str:
    """The fenced code blocks: the commands a reader runs."""
    return "\n".join(re.findall(r"^```.*?\n(.*?)^```", text, flags=re.S | re.M))


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", prose(page.read_text()), flags=re.M)
    return {slug(h) for h in headings}


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_pages_exist():
    names = {page_id(p) for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/api.md", "docs/architecture.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_path_leaves_the_repository(page):
    text = page.read_text()
    outside = re.findall(r"(?<![\w./-])(?:\.\./)*shared/[\w./-]*", text)  # the project's notes beside the repository
    assert not outside, f"{page_id(page)} points to files outside the repository: {sorted(set(outside))}"
    for target in re.findall(r"(?<![\w.])\.\./[\w./-]+", text):
        resolved = (page.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{page_id(page)} points outside the repository: {target}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_reaches_a_file_and_heading(page):
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        assert destination.is_relative_to(ROOT), f"{page_id(page)} links outside the repository: {target}"
        assert destination.exists(), f"{page_id(page)} links to {target}, which does not exist"
        if anchor and destination.suffix == ".md":
            assert anchor in anchors(destination), f"{page_id(page)} links to {target}: no such heading"


def test_the_docs_index_lists_every_page():
    """docs/README.md, the index the README links to, lists every page in docs/."""
    docs = ROOT / "docs"
    linked = {(docs / t.partition("#")[0]).resolve() for t in relative_links(docs / "README.md")}
    pages = {p.resolve() for p in docs.glob("*.md")} - {(docs / "README.md").resolve()}
    assert pages <= linked, f"docs/README.md does not list {sorted(p.name for p in pages - linked)}"
    assert "docs/README.md" in relative_links(ROOT / "README.md")


def test_the_files_the_examples_pass_exist():
    files = {name for page in PAGES for name in re.findall(r"--(?:json-schema|grammar) (\S+)", code(page.read_text()))}
    assert files, "the structured-output examples pass a schema file"
    for name in files:
        assert (ROOT / name).is_file(), f"the docs pass {name}, which the repository does not ship"
