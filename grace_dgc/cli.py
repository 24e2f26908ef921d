"""The ``grace-dgc`` command: ``list`` the registry, a ``demo``, and the survey tools
(``survey``, ``report``, ``project``).

A user's mistake (a misspelt name, a bad value, a missing file or folder) ends in one line on
stderr naming it and the fix, exit status 2; anything else is a bug and keeps its traceback.
``--debug`` (or ``GRACE_DGC_DEBUG=1``) shows the traceback of a user error too."""

from __future__ import annotations

import argparse
import inspect
import os
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import registry
from .cli_support import USER_ERRORS, OneLineParser, command_providers, debug_requested, error_line, listings

if TYPE_CHECKING:
    from .interfaces import Compressor

__all__ = ["USER_ERRORS", "OneLineParser", "build_parser", "debug_requested", "error_line", "main", "registry_table"]


def _params(cls: type[object]) -> str:
    sig = inspect.signature(cls.__init__)
    return ", ".join(
        f"{p.name}={p.default!r}"
        for p in list(sig.parameters.values())[1:]
        if p.name != "engine" and p.default is not p.empty
    )


def _summary(cls: type[object]) -> str:
    """The docstring's first line, carried on through the paragraph until its parentheses
    close (a citation may wrap), without reST's double backquotes."""
    lines = (inspect.getdoc(cls) or "").split("\n\n")[0].split("\n")
    text = lines[0]
    for line in lines[1:]:
        if text.count("(") <= text.count(")"):
            break
        text += " " + line.strip()
    depth, end = 0, len(text)
    for i, char in enumerate(text):  # where the first opened parenthesis closes, if the line ran past it
        depth += (char == "(") - (char == ")")
        if depth == 0 and char == ")" and i >= len(lines[0]):
            end = i + 1
            break
    return text[:end].replace("``", "").rstrip(".:;, ")


def _fitting(cls: type[Compressor]) -> str:
    """The communicators that fit compressor ``cls`` (built with its defaults: which fit
    depends on the class only)."""
    method = cls()
    return ", ".join(c for c in registry.COMMUNICATORS.names() if registry.COMMUNICATORS.get(c).fits(method))


KIND_TITLES = {
    "compressor": "compressors: what goes on the wire",
    "memory": "memories: error feedback, what was not sent is kept",
    "communicator": "communicators: how payloads move",
}


def registry_table(markdown: bool = False, width: int | None = None) -> str:
    """The methods table (as in the README): one row per registered name. As text, one row a
    line where ``width`` (default: the terminal's, 100 columns where stdout is not a terminal)
    holds it, else a block per name, wrapped to ``width``."""
    rows = []
    for kind, reg in (
        ("compressor", registry.COMPRESSORS),
        ("memory", registry.MEMORIES),
        ("communicator", registry.COMMUNICATORS),
    ):
        for name in reg.names():
            cls = reg.get(name)
            extra = _fitting(registry.COMPRESSORS.get(name)) if kind == "compressor" else ""
            rows.append((kind, name, ", ".join(reg.aliases_of(name)), _params(cls), extra, _summary(cls)))
    header = ("kind", "name", "aliases", "parameters (defaults)", "communicators", "what it is")
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += [
            "| " + " | ".join(f"`{c}`" if i == 1 else c.replace("|", "\\|") for i, c in enumerate(row)) + " |"
            for row in rows
        ]
        return "\n".join(lines)
    width = width or output_width()
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(5)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths) + "  {}"
    table = [fmt.format(*r).rstrip() for r in [header] + rows]
    if max(len(line) for line in table) <= width:
        return "\n".join(table)
    return _blocks(rows, width)


def output_width() -> int:
    """The columns text is wrapped to: the terminal's, or 100 where stdout is not a terminal (a log, a pipe)."""
    return shutil.get_terminal_size((100, 24)).columns if sys.stdout.isatty() else 100


def _blocks(rows: Sequence[tuple[str, ...]], width: int) -> str:
    """The registry as a block per name under a heading per kind, every line at most ``width``
    wide: the name, its aliases and what it is; its parameters; the communicators it fits."""
    width = max(width, 40)
    lines: list[str] = []
    for kind, title in KIND_TITLES.items():
        lines += ([""] if lines else []) + [title]
        for _, name, aliases, params, fitting, summary in (row for row in rows if row[0] == kind):
            also = f" (also {aliases})" if aliases else ""
            lines += textwrap.wrap(f"{name}{also}: {summary}", width, initial_indent="  ", subsequent_indent="      ")
            for label, text in (("parameters", params), ("communicators", fitting)):
                if text:
                    lines += textwrap.wrap(
                        f"{label}: {text}", width, initial_indent="      ", subsequent_indent="        "
                    )
    return "\n".join(lines)


def workloads_table() -> str:
    """The survey's workloads (``grace-dgc list workloads``), from the listing the survey provides."""
    return listings()["workloads"]()


def _cmd_list(args: argparse.Namespace) -> None:
    print(registry_table(markdown=args.markdown) if args.what == "methods" else listings()[args.what]())


def _add_demo(sub: argparse._SubParsersAction[OneLineParser]) -> None:
    p = sub.add_parser("demo", help="2-rank demo training on generated data: loss and bytes per method")
    p.add_argument("--workers", type=int, default=2, help="ranks (gloo processes on this machine; default 2)")
    p.add_argument("--steps", type=int, default=60, help="training steps per method (default 60)")
    p.add_argument(
        "--methods",
        default="none,fp16,topk:residual,randomk:residual,threshold:residual",
        help="comma-separated compressor[:memory] names",
    )
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> None:
    from .demo import plan, run_demo

    methods = plan(args.methods, args.workers, args.steps)  # named errors here, before any rank starts
    run_demo(methods, args.workers, args.steps)


def _version() -> str:
    """The installed distribution's version, else the package's ``__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("grace_dgc")
    except PackageNotFoundError:  # run from a source tree that is not installed
        import importlib

        return str(getattr(importlib.import_module("grace_dgc"), "__version__", "unknown"))


def build_parser() -> OneLineParser:
    """The whole command line: ``grace-dgc`` and its subcommands (the docs' commands are
    checked against it by a test)."""
    parser = OneLineParser(prog="grace-dgc", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"grace-dgc {_version()}")
    parser.add_argument(
        "--debug", action="store_true", help="show the full traceback of an error (as GRACE_DGC_DEBUG=1 does)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "list", help="print the registered compressors, memories and communicators (or the survey's workloads)"
    )
    others = sorted(listings())
    p.add_argument(
        "what", nargs="?", choices=("methods", *others), default="methods", help=f"methods or {', '.join(others)}"
    )
    p.add_argument("--markdown", action="store_true", help="as the README's Markdown table")
    p.set_defaults(func=_cmd_list)
    _add_demo(sub)
    for add_subcommands in command_providers():  # the survey's: survey, report, project
        add_subcommands(sub)
    for command in sub.choices.values():  # also after the subcommand: grace-dgc survey ... --debug
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as error:
        if debug_requested(args):  # the full traceback, for a bug report
            raise
        # a user's mistake: one line naming it (the messages name the fix); a bug keeps its traceback
        parser.exit(2, error_line(error) + "\n")
    except BrokenPipeError:  # the reader left (grace-dgc list | head): stop quietly
        # stdout to /dev/null, so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
