"""A griffe extension for the documentation site (mkdocs.yml): our docstrings head their doctests
``Example:`` (Google style allows it and Napoleon reads it), which griffe's Google parser takes
for an admonition, rendering ``>>>`` lines as Markdown (a ``[...]`` output becomes a broken
link). It renames such a heading to ``Examples:``, the section griffe parses into code blocks,
in the docstring griffe reads; the source is not touched."""

from __future__ import annotations

import re
from typing import Any

import griffe

HEADING = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = HEADING.sub(r"\1Examples:", obj.docstring.value)
