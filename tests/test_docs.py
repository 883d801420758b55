"""Every ```python block of the README and docs/ runs, in order, one namespace per file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text())


def test_the_docs_have_examples():
    assert sum(len(python_blocks(p)) for p in DOCS) >= 5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_examples_run(path: Path, monkeypatch, tmp_path):
    blocks = python_blocks(path)
    if not blocks:
        pytest.skip(f"{path.name} has no python example")
    monkeypatch.chdir(tmp_path)
    # The blocks run as a user's script: ``__name__ == "__main__"`` (the examples guard their
    # multi-process collectors with it, as scripts must), and cloudpickle sends what they define
    # by value to the workers, as it does for a user's ``__main__``.
    namespace: dict = {"__name__": "__main__"}
    for i, code in enumerate(blocks):
        compiled = compile(code, f"{path.name}[python block {i}]", "exec")
        exec(compiled, namespace)
    for value in list(namespace.values()):
        shutdown = getattr(value, "shutdown", None)
        if callable(shutdown) and type(value).__name__.endswith("Collector"):
            shutdown()


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_section_is_written_twice(path: Path):
    # Two "## Weights and devices" sections of the migration guide once said opposite things
    # (issue 25, item 9); a heading written twice also makes two identical anchors.
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sorted({s for s in sections if sections.count(s) > 1}) == []
