"""The README and docs/ point only inside the repository, and the example files their commands use are shipped."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = README + (ROOT / "docs" / "structured-output.md").read_text()  # the structured-output examples


def test_no_path_leaves_the_repository():
    outside = re.findall(r"(?<![\w.])\.\./[\w./-]+", README)
    assert not outside, f"the README points outside the repository: {sorted(set(outside))}"


def test_the_files_the_examples_pass_exist():
    files = set(re.findall(r"--(?:json-schema|grammar) (\S+)", DOCS))
    assert files, "the structured-output examples pass a schema file"
    for name in files:
        assert (ROOT / name).is_file(), f"the README passes {name}, which the repository does not ship"
