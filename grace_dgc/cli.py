"""The ``grace-dgc`` command: ``list`` the registry, a ``demo``, and the survey tools
(``survey``, ``report``, ``project``)."""

import argparse
import inspect
import os
import sys

from . import registry
from .errors import GraceConfigError


def _params(cls):
    sig = inspect.signature(cls.__init__)
    return ", ".join(
        f"{p.name}={p.default!r}"
        for p in list(sig.parameters.values())[1:]
        if p.name != "engine" and p.default is not p.empty
    )


def _summary(cls):
    return (inspect.getdoc(cls) or "").split("\n")[0].rstrip(".:")


def registry_table(markdown=False):
    """The methods table (as in the README): one row per registered name."""
    rows = []
    for kind, reg in (
        ("compressor", registry.COMPRESSORS),
        ("memory", registry.MEMORIES),
        ("communicator", registry.COMMUNICATORS),
    ):
        for name in reg.names():
            cls = reg.get(name)
            aliases = sorted(a for a, n in reg._aliases.items() if n == name and a != name)
            extra = ""
            if kind == "compressor":
                method = cls()  # defaults: which communicators fit depends on the class only
                fitting = [c for c in registry.COMMUNICATORS.names() if registry.COMMUNICATORS.get(c).fits(method)]
                extra = ", ".join(fitting)
            rows.append((kind, name, ", ".join(aliases), _params(cls), extra, _summary(cls)))
    header = ("kind", "name", "aliases", "parameters (defaults)", "communicators", "what it is")
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += [
            "| " + " | ".join(f"`{c}`" if i == 1 else c.replace("|", "\\|") for i, c in enumerate(row)) + " |"
            for row in rows
        ]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(5)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths) + "  {}"
    return "\n".join(fmt.format(*r) for r in [header] + rows)


def _cmd_list(args):
    print(registry_table(markdown=args.markdown))


def _add_demo(sub):
    p = sub.add_parser("demo", help="2-rank demo training on generated data: loss and bytes per method")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument(
        "--methods",
        default="none,fp16,topk:residual,randomk:residual,threshold:residual",
        help="comma-separated compressor[:memory] names",
    )
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args):
    from .demo import run_demo

    methods = [m.split(":") for m in args.methods.split(",")]
    for method in methods:  # named errors here, before any rank starts
        if len(method) > 2:
            raise GraceConfigError(f"--methods {':'.join(method)!r}: give compressor[:memory]")
        registry.COMPRESSORS.get(method[0])
        if len(method) == 2:
            registry.MEMORIES.get(method[1])
    run_demo(methods, args.workers, args.steps)


def _version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("grace_dgc")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def main(argv=None):
    parser = argparse.ArgumentParser(prog="grace-dgc", description=__doc__)
    parser.add_argument("--version", action="version", version=f"grace-dgc {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="print the registered compressors, memories and communicators")
    p.add_argument("--markdown", action="store_true", help="as the README's Markdown table")
    p.set_defaults(func=_cmd_list)
    _add_demo(sub)
    from .survey.cli import add_subcommands

    add_subcommands(sub)  # survey, report, project
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (GraceConfigError, FileNotFoundError, NotADirectoryError) as error:
        if os.environ.get("GRACE_DGC_DEBUG"):  # the full traceback, for a bug report
            raise
        # a user's mistake: one line naming it (the messages name the fix), as argparse does
        message = " ".join(str(error).split())
        parser.exit(2, f"grace-dgc: error: {message}\n")


if __name__ == "__main__":
    sys.exit(main())
