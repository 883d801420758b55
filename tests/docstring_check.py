"""Which parameters of a public class or function its docstring does not describe.

The docstrings are Google style: an ``Args:`` section (``Arguments:``, ``Parameters:`` and
``Keyword Args:`` are read too) with one entry per parameter, ``name: description`` or
``name (type): description``, the description going on over more-indented lines. A class's
parameters are its constructor's; they may be described in the class docstring or in
``__init__``'s (the documentation site merges both). A parameter counts as described when its
entry has a description of its own: an entry that only sends the reader elsewhere ("see
docs/x.md") does not count, since ``help()`` and the wheel have no docs/ folder.
"""

from __future__ import annotations

import enum
import inspect
import re

SECTIONS = ("Args", "Arguments", "Parameters", "Keyword Args", "Keyword Arguments", "Other Parameters")
ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_]\w*)(?:\s*\([^)]*\))?\s*:(.*)$")
ELSEWHERE = re.compile(r"^\W*(see|described in|as in)\b[^.]*(docs/|\.md\b|\.py\b)", re.I)


def described_parameters(doc: str) -> dict[str, str]:
    """``{name: description}`` for every entry of the docstring's Args-like sections."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc).splitlines()
    i = 0
    while i < len(lines):
        header = lines[i].strip()
        if header.rstrip(":") in SECTIONS and header.endswith(":"):
            base = len(lines[i]) - len(lines[i].lstrip())
            i += 1
            entry_indent, name = None, None
            while i < len(lines):
                line = lines[i]
                if line.strip():
                    indent = len(line) - len(line.lstrip())
                    if indent <= base:
                        break
                    if entry_indent is None:
                        entry_indent = indent
                    match = ENTRY.match(line.strip()) if indent == entry_indent else None
                    if match:
                        name = match.group(1).lstrip("*")
                        out[name] = match.group(2).strip()
                    elif name is not None:
                        out[name] = (out[name] + " " + line.strip()).strip()
                i += 1
            continue
        i += 1
    return out


def parameters(obj) -> list[str]:
    """The names a caller can pass: the function's, or the class constructor's (no ``self``)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [p.name for p in signature.parameters.values()]


def docstrings(obj) -> str:
    parts = [obj.__doc__ or ""]
    if inspect.isclass(obj) and "__init__" in vars(obj) and vars(obj)["__init__"].__doc__:
        parts.append(vars(obj)["__init__"].__doc__)
    return "\n\n".join(inspect.cleandoc(p) for p in parts if p)


def undocumented(obj) -> list[str]:
    """The parameters of ``obj`` with no description of their own in its docstring(s)."""
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        return []  # an enum is not constructed by users: its members are documented instead
    described = described_parameters(docstrings(obj))
    return [name for name in parameters(obj)
            if not described.get(name) or ELSEWHERE.match(described[name])]
