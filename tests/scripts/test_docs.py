"""What the documentation prints cannot drift from the code: every ``python`` block in the README
and the pages under docs/ compiles, every ``toml`` block parses (and a survey config among them
loads as one), and every ``grace-dgc`` command line in a ``bash`` block parses with the CLI's
own parser. The site itself is built with ``mkdocs build --strict`` by ``make docs`` (part of
``make test``), where a broken link, a missing anchor or an API reference to a name that no
longer exists fails."""

import re
import shlex
import tomllib
from pathlib import Path

import pytest

from grace_dgc.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)


def blocks(kind):
    return list(_blocks(kind))


def _blocks(kind):
    for page in PAGES:
        for match in FENCE.finditer(page.read_text()):
            if match.group(1) == kind and not match.group(0).startswith("````"):
                line = page.read_text()[: match.start()].count("\n") + 1
                yield pytest.param(match.group(2), id=f"{page.relative_to(ROOT)}:{line}")


def commands():
    return list(_commands())


INLINE = re.compile(r"(?<!`)`(grace-dgc [^`]+)`(?!`)")
PLACEHOLDERS = ("...", "…", "<", "|", "{")


def _commands():
    """Each ``grace-dgc`` line of the shell blocks, with comments and ``[optional]`` parts
    dropped; lines with placeholders (``...``, ``…``, ``<...>``, ``|``) are left out."""
    for kind in ("bash", "sh", "console", ""):
        for block in blocks(kind):
            for line in block.values[0].replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith("grace-dgc ") and not any(mark in line for mark in PLACEHOLDERS):
                    line = re.sub(r"\[[^\]]*\]", "", line)
                    yield pytest.param(line, id=f"{block.id}:{line[:50]}")


def inline_commands():
    """The ``grace-dgc …`` code spans of the prose: a subcommand and some of its options."""
    found = []
    for page in PAGES:
        for match in INLINE.finditer(page.read_text()):
            line = re.sub(r"\[[^\]]*\]", "", " ".join(match.group(1).split()))
            if not any(mark in line for mark in PLACEHOLDERS):
                found.append(pytest.param(line, id=f"{page.relative_to(ROOT)}:{line[:50]}"))
    return found


def test_there_is_something_to_check():
    assert len(blocks("python")) > 10 and len(commands()) > 5 and len(inline_commands()) > 20


@pytest.mark.parametrize("source", blocks("python"))
def test_python_blocks_compile(source):
    compile(source, "<docs>", "exec")


@pytest.mark.parametrize("source", blocks("toml"))
def test_toml_blocks_parse(source):
    tomllib.loads(source)


@pytest.mark.parametrize("line", commands())
def test_grace_dgc_commands_parse(line):
    argv = shlex.split(line)[1:]
    try:
        build_parser().parse_args(argv)
    except SystemExit as exit:  # argparse's way of refusing a line (or of printing --help/--version)
        assert exit.code == 0, f"the docs print a command the CLI refuses: {line}"


@pytest.mark.parametrize("line", inline_commands())
def test_the_options_the_prose_names_exist(line):
    """A span may leave required arguments out; each subcommand and option it names must exist."""
    import argparse

    words = shlex.split(line)[1:]
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if words and words[0].startswith("--"):  # an option of grace-dgc itself
        assert words[0] in {o for action in parser._actions for o in action.option_strings}, line
        return
    assert words and words[0] in commands, f"the docs name a subcommand the CLI lacks: {line}"
    known = {option for action in commands[words[0]]._actions for option in action.option_strings}
    for word in words[1:]:
        if word.startswith("--"):
            assert word.split("=")[0] in known, f"the docs name an option {words[0]} lacks: {word} in {line}"


def test_the_readme_and_getting_started_print_the_same_set_up_and_quickstart():
    """The README repeats the first page's set-up commands and quickstart: they may not drift apart."""
    readme, page = (ROOT / "README.md").read_text(), (ROOT / "docs" / "getting-started.md").read_text()
    shared = [m.group(0) for m in FENCE.finditer(readme)][:2]  # the set-up commands and the quickstart
    assert len(shared) == 2 and all(block in page for block in shared)


def set_up_commands(text):
    """The ``make`` targets of a page's first ``bash`` block (its set-up), in the order printed."""
    block = next(m.group(2) for m in FENCE.finditer(text) if m.group(1) == "bash")
    return [line.split()[1] for line in block.splitlines() if line.startswith("make ")]


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_set_up_starts_with_the_main_job_then_the_fast_tests_then_the_whole_suite(page):
    """A newcomer starts with ``make survey`` (it builds the environment and runs the main job),
    then ``make test-fast``; ``make test``, the whole suite, comes last (CI runs it: .ci/run)."""
    text = (ROOT / page).read_text()
    assert set_up_commands(text) == ["survey", "test-fast", "test"], set_up_commands(text)
    prose = " ".join(text[text.index("## Set-up") :].split("```")[2].split())  # the paragraph after the block
    assert "`make survey` alone builds the environment and runs the main job" in prose, prose[:300]
    assert "make test\n" in (ROOT / ".ci" / "run").read_text()  # the README's test command is CI's
