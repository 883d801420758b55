"""Every ```python block of the README and docs/ runs, in order, one namespace per file; the
documentation site builds (strict) and its API reference describes every parameter of every
public class."""

from __future__ import annotations

import enum
import html
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docstring_check import parameters

import rlcollect

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


# -- the built site ------------------------------------------------------------------------------

ROW = re.compile(r'<tr class="doc-section-item">\s*<td>\s*<code>\*{0,2}(\w+)</code>.*?'
                 r'<div class="doc-md-description">(.*?)</div>', re.S)
PUBLIC_CLASSES = [name for name in rlcollect.__all__ if inspect.isclass(getattr(rlcollect, name))]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="mkdocs is in the [docs] extra")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def class_parameters_on_page(page: str, name: str) -> dict[str, str]:
    """``{parameter: description text}`` of the class's own Parameters table on its API page
    (the part before its methods), as the reader sees them."""
    heading = re.search(rf'<h2 id="[\w.]*\.{name}" class="doc doc-heading">', page)
    assert heading, f"no heading for {name}"
    own = page[heading.end():]
    own = own[:own.find('<div class="doc doc-children">')] if 'doc doc-children' in own else own
    return {param: " ".join(html.unescape(re.sub(r"<[^>]+>", "", text)).split())
            for param, text in ROW.findall(own)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", PUBLIC_CLASSES)
def test_the_site_describes_every_parameter_of_each_public_class(site, name):
    # Collector and the multi-process collectors assign their __doc__ from a variable, which a
    # static reader misses (their pages once showed no parameter): scripts/griffe_docstrings.py.
    cls = getattr(rlcollect, name)
    expected = parameters(cls)
    if issubclass(cls, enum.Enum):
        pytest.skip(f"{name} is an enum: its page lists its members")
    if not expected:
        pytest.skip(f"{name}'s constructor takes no argument")
    shown = class_parameters_on_page((site / "api" / name / "index.html").read_text(), name)
    assert [p for p in expected if not shown.get(p)] == []


def test_every_guide_is_in_the_sites_nav_and_the_readmes_list():
    # The Ray guide was once in neither (issue 38, item 6).
    nav = (ROOT / "mkdocs.yml").read_text()
    readme = (ROOT / "README.md").read_text()
    guides = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")
    assert [g for g in guides if f": {g}\n" not in nav] == []
    assert [g for g in guides if f"(docs/{g})" not in readme] == []
