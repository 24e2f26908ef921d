"""Command-line front ends of the survey: ``survey``, ``report`` and ``project``.

Wired into the top-level ``grace-dgc`` command as subcommands::

    from .survey import cli as survey_cli
    survey_cli.add_subcommands(sub)          # sub = parser.add_subparsers(...)

(each subparser sets ``func``; ``args.func(args)`` returns the exit code), or one by one
with ``add_survey_args(parser)`` / ``run_survey(args)`` and likewise for report and project.
``python -m grace_survey.cli survey ...`` works on its own too.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from grace_dgc.cli_support import USER_ERRORS, OneLineParser, debug_requested, error_line
from grace_dgc.errors import GraceConfigError
from grace_survey.projection.project import add_project_args, run_project
from grace_survey.report.writer import add_report_args, run_report
from grace_survey.running.results import CONFIG_JSON, GRID_JSON, RESULTS, SUMMARY_CSV
from grace_survey.script.protocol import SCRIPT_RUNS

if TYPE_CHECKING:
    from grace_survey.config.settings import SurveyConfig

P = TypeVar("P", bound=argparse.ArgumentParser)
Command = Callable[[argparse.Namespace], int]

SURVEY_HELP = "run a grid of (method × workers × seed) trainings and write results, report and plots"
REPORT_HELP = "write report.md (the seeds' tables) and PNG plots from a survey directory"
PROJECT_HELP = "project step time and speedup over dense allreduce to N nodes (α-β model)"


def add_survey_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``survey``'s arguments: what to run (a preset or a config, or a script), the command
    line's overrides of the config, and how the run goes."""
    _add_what_to_run(parser)
    _add_overrides(parser)
    _add_run_options(parser)
    return parser


def _add_what_to_run(parser: argparse.ArgumentParser) -> None:
    """--preset or --config, --out, and script mode's --script and --launcher."""
    from grace_survey.config.presets import PRESET_ALIASES, PRESETS

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--preset",
        type=_preset,
        metavar="NAME",
        help=f"a built-in grid: {', '.join(PRESETS)} (earlier names {', '.join(PRESET_ALIASES)} still work)",
    )
    source.add_argument("--config", metavar="FILE.toml", help="a TOML grid (see benchmarks/configs/example.toml)")
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="results directory; rerunning with the same DIR skips finished runs"
    )
    parser.add_argument(
        "--script",
        metavar="TRAIN.py",
        help="script mode: run your own training script once per cell (it calls grace_survey.cell_grace() "
        "and survey.report_metrics(); docs/survey.md: Your own script); the config's methods, workers and seeds "
        "make the grid",
    )
    parser.add_argument(
        "--launcher",
        metavar="CMD",
        help="script mode: 'local' (default) or a command prefix that starts every rank of a cell, e.g. "
        "'horovodrun -np {workers} -H a:2,b:2' or 'torchrun --nproc-per-node {workers} --master-port {port}'",
    )


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    """What the command line overrides in the config: workers, epochs, steps, data, network."""
    parser.add_argument("--workers", metavar="N[,N...]", help="ranks per run (overrides the config)")
    parser.add_argument("--epochs", type=int, help="epochs per run (overrides the config)")
    parser.add_argument(
        "--seeds",
        type=_seeds,
        metavar="S[,S...]",
        help="the seeds to run, e.g. 0,1,2 or 0-4 (overrides seeds/repeats in the config)",
    )
    parser.add_argument("--max-steps", type=int, metavar="S", help="at most S steps per epoch (overrides)")
    parser.add_argument(
        "--data-dir",
        metavar="D",
        help="dataset files (never downloaded; must exist); presets switch to MNIST where they have a file workload",
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


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """How the survey runs and what it writes besides the results; script mode's --script-args last."""
    parser.add_argument(
        "--tensorboard",
        action="store_true",
        help="log per-step scalars to OUT/tensorboard/<run> (needs the tensorboard extra)",
    )
    parser.add_argument("--no-report", action="store_true", help="skip writing report.md and the plots")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    parser.add_argument(
        "--fresh-ranks",
        action="store_true",
        help="start the ranks afresh for every run (default: one pool of ranks per world size, kept up across runs)",
    )
    parser.add_argument("--network-tag", help=argparse.SUPPRESS)  # internal: the shaped child's share
    parser.add_argument(
        "--script-args",
        nargs=argparse.REMAINDER,
        metavar="ARG",
        help="script mode: everything after this goes to the script (give it last)",
    )


def _preset(name: str) -> str:
    """``--preset``'s type: a known name (or an earlier one), else the suggestion of the closest."""
    from grace_survey.config.presets import preset_name

    try:
        preset_name(name)
    except GraceConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return name


def _seeds(text: str) -> list[int]:
    """``--seeds``' type: ``0,1,2``, ``0-4`` or a mix (``0-2,7``): distinct ints >= 0."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            low, dash, high = part.strip().partition("-")
            seeds += range(int(low), int(high) + 1) if dash else [int(low)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give seeds as 0,1,2 or a range 0-4") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct seeds >= 0, as 0,1,2 or a range 0-4")
    return seeds


def _existing_dir(path: str, named: str) -> None:
    """``path`` (a data directory, ``named`` as the user gave it) exists and is a directory."""
    if not os.path.exists(path):
        raise GraceConfigError(f"{named} does not exist; give an existing directory holding the data files")
    if not os.path.isdir(path):
        raise GraceConfigError(f"{named} is a file, not a directory; give the directory holding the data files")


def _checked_config(args: argparse.Namespace) -> SurveyConfig:
    """The survey's config with the command line's overrides, everything the run reads checked
    (names, values, --out, --data-dir, data files): a user error raises here, before the
    output directory is created."""
    from grace_survey.config.settings import (
        SurveyConfig,
        load_config,
        load_preset,
        preset_dict,
        script_mode,
        with_overrides,
    )
    from grace_survey.workloads.datasets import check_files

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise GraceConfigError(f"--out {args.out} is a file; give a directory (new, or holding an earlier run)")
    if args.data_dir is not None:  # an error even where no workload reads files: it was meant for something
        _existing_dir(args.data_dir, f"--data-dir {args.data_dir}")
    if args.script is not None and not os.path.isfile(args.script):
        raise GraceConfigError(f"--script {args.script}: no such file; give the path of your training script")
    if args.config:
        config = load_config(args.config, script=args.script)
    elif args.script:  # a preset's methods on the user's script
        config = SurveyConfig(script_mode(preset_dict(args.preset), args.script), source=f"preset {args.preset}")
    else:
        config = load_preset(args.preset, args.data_dir)
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
    if config.script is None and args.script is None and (args.script_args is not None or args.launcher is not None):
        raise GraceConfigError("--script-args and --launcher belong to script mode: add --script TRAIN.py")
    config = with_overrides(
        config,
        workers=workers,
        epochs=args.epochs,
        data_dir=args.data_dir,
        network=network,
        max_steps=args.max_steps,
        tensorboard=args.tensorboard,
        script=args.script,
        script_args=args.script_args,
        launcher=args.launcher,
    )
    if args.seeds is not None:  # the seeds replace the config's seeds or repeats
        raw = {k: v for k, v in config.to_dict().items() if k != "repeats"}
        config = SurveyConfig(dict(raw, seeds=args.seeds, name=config.name), source=config.source)
    if args.data_dir is None and config.data_dir is not None:
        _existing_dir(config.data_dir, f"data_dir = {config.data_dir!r} in {config.source}")
    check_files(config.workload, config.data_dir)  # present, not yet read: no folder is created first
    return config


class _Undo:
    """What a failed survey leaves: nothing it wrote before its first recorded run. A folder
    it created is removed; in one that was there, only the survey's own entries that it
    added (and survey_config.json and survey_grid.json restored); the user's files are never
    touched."""

    ENTRIES = (CONFIG_JSON, GRID_JSON, RESULTS, SUMMARY_CSV, "data-cache", "tensorboard", SCRIPT_RUNS)
    RESTORED = (CONFIG_JSON, GRID_JSON)

    def __init__(self, out: str) -> None:
        self.out = os.path.abspath(out)
        self.root: str | None = None  # the topmost folder this run will create
        path = self.out
        while not os.path.exists(path) and os.path.dirname(path) != path:
            self.root, path = path, os.path.dirname(path)
        self.present = set() if self.root else {e for e in self.ENTRIES if os.path.exists(self._at(e))}
        self.saved = {e: self._read(e) for e in self.RESTORED if e in self.present}
        self.results = self._size(RESULTS)

    def _at(self, entry: str) -> str:
        return os.path.join(self.out, entry)

    def _read(self, entry: str) -> bytes:
        with open(self._at(entry), "rb") as f:
            return f.read()

    def _size(self, entry: str) -> int | None:
        return os.path.getsize(self._at(entry)) if os.path.isfile(self._at(entry)) else None

    def __call__(self) -> None:
        if self._size(RESULTS) != self.results:
            return  # a run was recorded: keep it (rerunning resumes)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        for entry in self.ENTRIES:
            path = self._at(entry)
            if entry in self.present or not os.path.lexists(path):
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
        for entry, content in self.saved.items():
            if os.path.isfile(self._at(entry)) and self._read(entry) == content:
                continue
            with open(self._at(entry), "wb") as f:
                f.write(content)


def run_survey(args: argparse.Namespace) -> int:
    from grace_survey.running import netem
    from grace_survey.running.grid import run_grid

    # a shaped network's child works in its parent's folder: the parent cleans up
    undo = _Undo(args.out) if args.network_tag is None else None
    try:
        config = _checked_config(args)
        summaries, failures = run_grid(
            config, args.out, progress=not args.no_progress, network_tag=args.network_tag, fresh_ranks=args.fresh_ranks
        )
    except USER_ERRORS + (netem.NetemUnavailable,) as err:  # a bad config, missing data files, no netem
        if undo is not None:
            undo()
        if debug_requested(args):
            raise
        print(error_line(err), file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # ^C: the ranks are stopped; what was recorded stays
        if undo is not None:
            undo()
        if args.network_tag is None:  # a shaped network's child leaves the word to its parent
            print(_interrupted_line(stop, args), file=sys.stderr)
        return EXIT_INTERRUPTED
    except BaseException:  # a bug (its traceback shown): still nothing half-written
        if undo is not None:
            undo()
        raise
    if args.network_tag is None and not args.no_report:
        from grace_survey.report.writer import write_report

        try:
            print(f"wrote {write_report(args.out)}")
        except GraceConfigError as err:
            print(f"no report: {err}", file=sys.stderr)
    if failures:
        print(
            f"{len(failures)} run(s) failed: {', '.join(f[0] for f in failures)} "
            f"(details in {args.out}/results.jsonl; rerun to retry them)",
            file=sys.stderr,
        )
        return 1
    return 0


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


def _interrupted_line(stop: KeyboardInterrupt, args: argparse.Namespace) -> str:
    """The one line a Ctrl-C ends a survey with: the runs kept, the runs left, the command
    that finishes the survey (it skips the runs kept)."""
    from grace_survey.running.grid import SurveyInterrupted

    command = _this_command(args)
    if not isinstance(stop, SurveyInterrupted):  # before the first run started: nothing was kept
        return f"interrupted before any run started; to run the survey: {command}"
    if stop.kept == 0:
        return f"interrupted before any of its {stop.total} runs finished: nothing kept; to run the survey: {command}"
    left = stop.total - stop.kept
    return f"interrupted: {stop.kept} of {stop.total} runs kept, {left} left; run the same command to finish: {command}"


def _this_command(args: argparse.Namespace) -> str:
    """The command line that started this survey, as the user can type it again (where the
    survey was started from Python, its --config or --preset and --out)."""
    argv = sys.argv[1:]
    if "survey" in argv:
        survey_module = sys.argv[0].endswith(os.path.join("grace_survey", "cli.py"))
        return f"{'python -m grace_survey.cli' if survey_module else 'grace-dgc'} {shlex.join(argv)}"
    source = ["--config", args.config] if args.config else ["--preset", args.preset]
    return shlex.join(["grace-dgc", "survey", *source, "--out", args.out])


def _guarded(fn: Command) -> Command:
    """``fn(args)`` with a user error as one line and exit status 2 (see :mod:`grace_dgc.cli`)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except USER_ERRORS as err:
            if debug_requested(args):
                raise
            print(error_line(err), file=sys.stderr)
            return 2

    return run


def add_subcommands(sub: argparse._SubParsersAction[P]) -> argparse._SubParsersAction[P]:
    """Add ``survey``, ``report`` and ``project`` to an ``add_subparsers()`` object."""
    p = add_survey_args(sub.add_parser("survey", help=SURVEY_HELP, description=SURVEY_HELP))
    p.set_defaults(func=run_survey)
    p = add_report_args(sub.add_parser("report", help=REPORT_HELP, description=REPORT_HELP))
    p.set_defaults(func=_guarded(run_report))
    from grace_survey.projection import project

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


def survey_main(argv: Sequence[str] | None = None) -> int:
    return run_survey(add_survey_args(OneLineParser(prog="grace-dgc survey", description=SURVEY_HELP)).parse_args(argv))


def report_main(argv: Sequence[str] | None = None) -> int:
    return _guarded(run_report)(
        add_report_args(OneLineParser(prog="grace-dgc report", description=REPORT_HELP)).parse_args(argv)
    )


def project_main(argv: Sequence[str] | None = None) -> int:
    from grace_survey.projection import project

    parser = OneLineParser(
        prog="grace-dgc project", description=project.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return _guarded(run_project)(add_project_args(parser).parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m grace_survey.cli")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
