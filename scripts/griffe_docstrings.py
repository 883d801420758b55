"""Griffe extensions for the documentation site (mkdocs.yml). Griffe reads the package's source
without importing it (building the site imports neither rlcollect nor torch); two of our
docstring habits need help there:

- ``AssignedDocstrings``: a class whose docstring is assigned, ``__doc__ = COLLECTOR_DOC``
  (``Collector``, ``MultiSyncCollector``, ``MultiAsyncCollector``, ``MultiCollector``: their
  long argument lists live in a module of their own, or are shared), has no docstring to a
  static reader, so its page showed no description and no parameter. The extension evaluates
  the assignment from the source: string literals, ``+``, and names of module-level strings
  (followed through imports), which is every form the package uses; anything else is reported,
  and the strict build fails on it.
- ``ClassAliases``: ``DistributedDataCollector = DistributedCollector`` (torchrl's name for the
  same class) is a module attribute to a static reader, and its page showed only that line. A
  module attribute whose value is the bare name of a class becomes an alias of that class, which
  the site documents in full under the alias's name.
- ``ExampleSections``: our docstrings head their doctests ``Example:`` (Google style allows it
  and Napoleon reads it), which griffe's Google parser takes for an admonition, rendering
  ``>>>`` lines as Markdown (a ``[...]`` output becomes a broken link). Such a heading is
  renamed ``Examples:``, the section griffe parses into code blocks, in the docstring griffe
  reads; the source is not touched.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import griffe

HEADING = re.compile(r"^(\s*)Example:\s*$", re.M)
LOGGER = griffe.logger


def rename_example_headings(docstring: griffe.Docstring) -> None:
    docstring.value = HEADING.sub(r"\1Examples:", docstring.value)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            rename_example_headings(obj.docstring)


class AssignedDocstrings(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for cls in _classes(pkg):
            assigned = cls.members.get("__doc__")
            if cls.docstring is not None or assigned is None or not assigned.is_attribute:
                continue
            value = _string(assigned.value, loader.modules_collection)
            if value is None:
                LOGGER.warning("%s: __doc__ = %s is not a string griffe can evaluate statically (string literals, "
                               "+, names of module-level strings)", cls.path, assigned.value)
                continue
            cls.docstring = griffe.Docstring(value, lineno=assigned.lineno, endlineno=assigned.endlineno, parent=cls,
                                             parser=loader.docstring_parser, parser_options=loader.docstring_options)
            rename_example_headings(cls.docstring)


class ClassAliases(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for module in [pkg, *_modules(pkg)]:
            for name, member in list(module.members.items()):
                if member.is_alias or not member.is_attribute or member.docstring is not None:
                    continue
                if not isinstance(member.value, griffe.ExprName):
                    continue
                try:
                    target = loader.modules_collection.get_member(member.value.canonical_path)
                except KeyError:
                    continue
                if not target.is_alias and target.is_class:
                    module.set_member(name, griffe.Alias(name, target, lineno=member.lineno,
                                                         endlineno=member.endlineno, parent=module))


def _modules(obj: griffe.Module):
    for member in obj.members.values():
        if not member.is_alias and member.is_module:
            yield member
            yield from _modules(member)


def _classes(obj: griffe.Object):
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_class:
            yield member
        if member.is_module or member.is_class:
            yield from _classes(member)


def _string(value: Any, modules: griffe.ModulesCollection, depth: int = 0) -> str | None:
    """The string an attribute's value (a griffe expression, or a literal's source) evaluates to,
    or None when it is not built from string literals, ``+`` and names of such strings."""
    if depth > 20:  # a cycle of names
        return None
    if isinstance(value, str):
        try:
            literal = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return None
        return literal if isinstance(literal, str) else None
    if isinstance(value, griffe.ExprBinOp) and value.operator == "+":
        left, right = _string(value.left, modules, depth + 1), _string(value.right, modules, depth + 1)
        return None if left is None or right is None else left + right
    if isinstance(value, (griffe.ExprName, griffe.ExprAttribute)):
        try:
            target = modules.get_member(value.canonical_path)
            if target.is_alias:
                target = target.final_target
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
        return _string(target.value, modules, depth + 1) if target.is_attribute else None
    return None
