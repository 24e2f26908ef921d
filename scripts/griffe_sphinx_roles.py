"""The docstrings' Sphinx roles as links in the API reference (a griffe extension, mkdocs.yml).

The docstrings cross-reference with Sphinx roles (``:class:`Grace```, ``:meth:`~grace_dgc.Grace.stats```,
``:func:`build```), which read well in ``help()`` but which mkdocstrings prints as raw text. When
griffe has loaded a package, this rewrites each role of a docstring into an mkdocs-autorefs
reference to the object it names, found as Sphinx finds it: a full path as it stands, else the
first name in the docstring's own scope (the object, its class, its module and what the module
imports, then the package), else the one loaded object whose path ends with the name. Aliases
(``grace_dgc.Grace``) lead to where the object is defined (``grace_dgc.grace.Grace``), whose page
the reference links to. A name that names nothing loaded, or nothing the site renders (a private
method, torch's classes), is left as code: the reference is optional, so mkdocs-autorefs prints it
as ``<code>`` without a link and without a warning. The docstrings themselves are not changed on
disk, so ``help()`` keeps its Sphinx roles.

Sphinx's forms: ``~a.b.C`` shows ``C``; ``!name`` is never a link; ``title <target>`` shows the
title; a leading ``.`` asks for a search by suffix.
"""

from __future__ import annotations

import functools
import html
import re
from collections.abc import Iterator
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?P<role>class|meth|func|attr|mod|data|obj|exc|const):`(?P<body>[^`]+)`")


def _walk(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined in it (imports and other aliases left out)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)  # type: ignore[arg-type]  # an alias is never passed on


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles into mkdocs-autorefs references, once a package is loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.packages: list[griffe.Module] = []

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        self.packages.append(pkg)
        for obj in _walk(pkg):
            docstring = obj.docstring
            if docstring is not None and ":" in docstring.value:
                docstring.value = ROLE.sub(functools.partial(self.reference, obj, loader), docstring.value)

    def reference(self, obj: griffe.Object, loader: griffe.GriffeLoader, match: re.Match[str]) -> str:
        body = " ".join(match["body"].split())
        title = None
        if body.endswith(">") and " <" in body:  # :func:`the title <target>`
            title, body = body[:-1].split(" <", 1)
        if body.startswith("!"):  # Sphinx: no link
            return f"<code>{html.escape(body[1:])}</code>"
        short = body.startswith("~")
        target = body.lstrip("~.")
        shown = title or (target.rsplit(".", 1)[-1] if short else target)
        path = self.resolve(obj, loader, target)
        if path is None:
            return f"<code>{html.escape(shown)}</code>"
        return f'<autoref identifier="{html.escape(path)}" optional><code>{html.escape(shown)}</code></autoref>'

    def resolve(self, obj: griffe.Object, loader: griffe.GriffeLoader, target: str) -> str | None:
        """The path where the object ``target`` names (seen from ``obj``'s docstring) is defined."""
        first, _, rest = target.partition(".")
        candidates = [target]
        try:
            scoped = obj.resolve(first)
        except griffe.NameResolutionError:
            pass
        else:
            candidates.insert(0, f"{scoped}.{rest}" if rest else scoped)
        for package in self.packages:  # the package's own top-level name (``build`` of grace_dgc)
            candidates.append(f"{package.path}.{target}")
        for candidate in candidates:
            found = self._defined_at(loader, candidate)
            if found is not None:
                return found
        # a full path not loaded yet (grace_dgc's docstrings are read before grace_survey is
        # loaded): as written; the reference is optional, so a path that is rendered nowhere is code
        return self._by_suffix(target) or (target if "." in target else None)

    @staticmethod
    def _defined_at(loader: griffe.GriffeLoader, path: str) -> str | None:
        try:
            found = loader.modules_collection[path]
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
        if found.is_alias:
            try:
                return str(found.final_target.path)
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                return None
        return str(found.path)

    def _by_suffix(self, target: str) -> str | None:
        """The one object of the loaded packages whose path ends with ``.target`` (None: none, or several)."""
        suffix = "." + target
        found = {obj.path for package in self.packages for obj in _walk(package) if obj.path.endswith(suffix)}
        return found.pop() if len(found) == 1 else None
