"""Command-line front ends of the survey: ``survey``, ``report`` and ``project``.

Wired into the top-level ``grace-dgc`` command as subcommands::

    from .survey import cli as survey_cli
    survey_cli.add_subcommands(sub)          # sub = parser.add_subparsers(...)

(each subparser sets ``func``; ``args.func(args)`` returns the exit code), or one by one
with ``add_survey_args(parser)`` / ``run_survey(args)`` and likewise for report and project.
``python -m grace_dgc.survey.cli survey ...`` works on its own too.
"""

import argparse
import os
import shutil
import sys

from ..errors import GraceConfigError
from .project import add_project_args, run_project
from .report import add_report_args, run_report

SURVEY_HELP = "run a grid of (method × workers × seed) trainings and write results, report and plots"
REPORT_HELP = "write report.md (the seeds' tables) and PNG plots from a survey directory"
PROJECT_HELP = "project step time and speedup over dense allreduce to N nodes (α-β model)"


def add_survey_args(parser):
    from .presets import PRESET_ALIASES, PRESETS

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--preset",
        choices=[*PRESETS, *PRESET_ALIASES],
        metavar="NAME",
        help=f"a built-in grid: {', '.join(PRESETS)} (earlier names {', '.join(PRESET_ALIASES)} still work)",
    )
    source.add_argument("--config", metavar="FILE.toml", help="a TOML grid (see benchmarks/configs/example.toml)")
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="results directory; rerunning with the same DIR skips finished runs"
    )
    parser.add_argument("--workers", metavar="N[,N...]", help="ranks per run (overrides the config)")
    parser.add_argument("--epochs", type=int, help="epochs per run (overrides the config)")
    parser.add_argument("--max-steps", type=int, metavar="S", help="at most S steps per epoch (overrides)")
    parser.add_argument(
        "--data-dir",
        metavar="D",
        help="dataset files (never downloaded); presets switch to MNIST where they have a file workload",
    )
    parser.add_argument(
        "--bandwidth",
        metavar="RATE",
        help="run every rank on a loopback shaped to RATE, shared by all ranks (e.g. 1gbit; "
        "N ranks ≈ hosts with RATE/N links each); needs root/CAP_NET_ADMIN and tc",
    )
    parser.add_argument(
        "--latency", metavar="MS", help="one-way delay in ms added on the shaped loopback (needs the netem qdisc)"
    )
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="log per-step scalars to OUT/tensorboard/<run> (needs the tensorboard extra)",
    )
    parser.add_argument("--no-report", action="store_true", help="skip writing report.md and the plots")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    parser.add_argument("--network-tag", help=argparse.SUPPRESS)  # internal: the shaped child's share
    return parser


def run_survey(args):
    from . import netem
    from .config import load_config, load_preset, with_overrides
    from .grid import run_grid

    fresh = not os.path.exists(args.out)  # a run that fails before any result leaves no folder behind
    try:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise GraceConfigError(f"--out {args.out} is a file; give a directory (new, or holding an earlier run)")
        if args.data_dir is not None and not os.path.isdir(args.data_dir):
            raise GraceConfigError(f"--data-dir {args.data_dir} does not exist; give the directory with the data files")
        config = load_config(args.config) if args.config else load_preset(args.preset, args.data_dir)
        workers: int | list[int] | None = None
        if args.workers:
            try:
                counts = [int(w) for w in str(args.workers).split(",")]
            except ValueError:
                raise GraceConfigError(f"--workers {args.workers!r} must be an int or comma-separated ints") from None
            workers = counts[0] if len(counts) == 1 else counts
        network = None
        if args.bandwidth or args.latency:
            network = {k: v for k, v in (("bandwidth", args.bandwidth), ("latency", args.latency)) if v}
        config = with_overrides(
            config,
            workers=workers,
            epochs=args.epochs,
            data_dir=args.data_dir,
            network=network,
            max_steps=args.max_steps,
            tensorboard=args.tensorboard,
        )
        summaries, failures = run_grid(config, args.out, progress=not args.no_progress, network_tag=args.network_tag)
        if args.network_tag is None and not args.no_report:
            from .report import write_report

            try:
                print(f"wrote {write_report(args.out)}")
            except GraceConfigError as err:
                print(f"no report: {err}", file=sys.stderr)
    except netem.NetemUnavailable as err:
        print(f"grace-dgc: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except (GraceConfigError, FileNotFoundError) as err:  # a bad config, missing data files
        print(f"grace-dgc: error: {' '.join(str(err).split())}", file=sys.stderr)
        if fresh and os.path.isdir(args.out) and not os.path.exists(os.path.join(args.out, "results.jsonl")):
            shutil.rmtree(args.out)  # only what this run created, and it holds no result
        return 2
    if failures:
        print(
            f"{len(failures)} run(s) failed: {', '.join(f[0] for f in failures)} "
            f"(details in {args.out}/results.jsonl; rerun to retry them)",
            file=sys.stderr,
        )
        return 1
    return 0


def _guarded(fn):
    def run(args):
        try:
            return fn(args)
        except GraceConfigError as err:
            print(f"grace-dgc: error: {' '.join(str(err).split())}", file=sys.stderr)
            return 2

    return run


def add_subcommands(sub):
    """Add ``survey``, ``report`` and ``project`` to an ``add_subparsers()`` object."""
    p = add_survey_args(sub.add_parser("survey", help=SURVEY_HELP, description=SURVEY_HELP))
    p.set_defaults(func=run_survey)
    p = add_report_args(sub.add_parser("report", help=REPORT_HELP, description=REPORT_HELP))
    p.set_defaults(func=_guarded(run_report))
    from . import project

    p = add_project_args(
        sub.add_parser(
            "project",
            help=PROJECT_HELP,
            description=project.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    p.set_defaults(func=_guarded(run_project))
    return sub


def survey_main(argv=None):
    return run_survey(
        add_survey_args(argparse.ArgumentParser(prog="grace-dgc survey", description=SURVEY_HELP)).parse_args(argv)
    )


def report_main(argv=None):
    return _guarded(run_report)(
        add_report_args(argparse.ArgumentParser(prog="grace-dgc report", description=REPORT_HELP)).parse_args(argv)
    )


def project_main(argv=None):
    from . import project

    parser = argparse.ArgumentParser(
        prog="grace-dgc project", description=project.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return _guarded(run_project)(add_project_args(parser).parse_args(argv))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m grace_dgc.survey.cli")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
