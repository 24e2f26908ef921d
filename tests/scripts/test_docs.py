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


def sphinx_roles_extension():
    """scripts/griffe_sphinx_roles.py, the griffe extension mkdocs.yml loads by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("griffe_sphinx_roles", ROOT / "scripts" / "griffe_sphinx_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.fast  # single-process, but griffe asks git where the package's repository is (one short process)
def test_sphinx_roles_become_references_to_where_the_object_is_defined_or_code(tmp_path):
    griffe = pytest.importorskip("griffe")
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        '"""The package: :func:`make` makes a :class:`Thing`."""\n\nfrom .core import Thing, make\n'
    )
    (package / "core.py").write_text(
        '"""See :class:`~pkg.core.Thing`, :meth:`Thing.go`, :func:`.make`, :mod:`pkg.core`,\n'
        ':func:`the maker <make>`, :class:`torch.Tensor`, :meth:`!nolink`, :func:`missing`, :func:`helper`."""\n\n\n'
        "class Thing:\n"
        '    """A thing."""\n\n'
        "    def go(self):\n"
        '        """Go; then :meth:`stop`; also :py:func:`pkg.make`."""\n\n'
        "    def stop(self):\n"
        '        """Stop."""\n\n\n'
        "def make():\n"
        '    """Make one."""\n'
    )
    (package / "other.py").write_text('def helper():\n    """Help."""\n')  # imported by no one
    loader = griffe.GriffeLoader(
        extensions=griffe.load_extensions(sphinx_roles_extension().SphinxRoles()), search_paths=[str(tmp_path)]
    )
    pkg = loader.load("pkg")

    def ref(path, shown):
        return f'<autoref identifier="{path}" optional><code>{shown}</code></autoref>'

    assert (
        pkg.docstring.value == f"The package: {ref('pkg.core.make', 'make')} makes a {ref('pkg.core.Thing', 'Thing')}."
    )
    core = pkg["core"].docstring.value
    for expected in (
        ref("pkg.core.Thing", "Thing"),  # ~ shows the last name
        ref("pkg.core.Thing.go", "Thing.go"),  # scoped: the module's class
        ref("pkg.core.make", "make"),  # .name: a search by suffix
        ref("pkg.core", "pkg.core"),
        ref("pkg.core.make", "the maker"),  # title <target>
        ref("torch.Tensor", "torch.Tensor"),  # a full path not loaded: optional, so code unless rendered
        "<code>nolink</code>",  # !: never a link
        "<code>missing</code>",  # names nothing: code
        ref("pkg.other.helper", "helper"),  # the one loaded object of that name
    ):
        assert expected in core, (expected, core)
    assert (
        pkg["core.Thing.go"].docstring.value
        == f"Go; then {ref('pkg.core.Thing.stop', 'stop')}; also {ref('pkg.core.make', 'pkg.make')}."
    )


RAW_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|data|obj|exc|const):(?:`|&#x60;|<code>)")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The documentation site, built as ``make docs`` builds it (--strict) into a folder of its own."""
    import os
    import subprocess
    import sys

    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_the_built_site_shows_no_raw_sphinx_role_and_links_the_cross_references(site):
    pages = {page.relative_to(site).as_posix(): page.read_text() for page in site.rglob("*.html")}
    raw = {name: RAW_ROLE.findall(text) for name, text in pages.items() if RAW_ROLE.search(text)}
    assert raw == {}, raw
    api = "".join(text for name, text in pages.items() if name.startswith("api/"))
    links = re.findall(r'<a class="autorefs autorefs-internal"[^>]*><code>', api)
    assert len(links) > 100, len(links)  # the docstrings' roles, now links (195 when written)
    core = pages["api/core/index.html"]
    # a role resolved in its docstring's scope: :meth:`Grace.close` in build's docstring (grace_dgc.registry, where
    # Grace is imported) links to the method on the core page
    interfaces = pages["api/interfaces/index.html"]  # build lives beside the registry (issue 55)
    assert re.search(r'href="\.\./core/#grace_dgc\.grace\.Grace\.(\w+)"><code>Grace\.\1</code></a>', interfaces)
    signature = re.sub(r"<[^>]+>", "", interfaces[interfaces.index('id="grace_dgc.registry.build"') :][:4000])
    assert "compressor: str" in signature and "-&gt; Grace" in signature, signature[:600]  # typed signatures
    hook = core[core.index('id="grace_dgc.training.ddp.ddp_comm_hook"') :][:8000]
    assert "<th>Type</th>" in hook and "<code>optimizer</code>" in hook  # :param: fields as a table


def test_the_navigation_groups_the_results_and_leaves_the_run_logs_out(site):
    home = (site / "index.html").read_text()
    nav = home[home.index('<nav class="md-nav md-nav--primary"') :]
    assert re.search(r">\s*Results\s*<", nav) and re.search(r">\s*GPU checks\s*<", nav)
    assert re.search(r">\s*Survey reports", nav) and "issue 40" not in nav
    for log in ("h100-session-2026-11-28", "h200-session-runs"):  # a lent machine's raw outputs
        assert (site / "results" / log / "index.html").exists() and f"results/{log}/" not in nav, log


def test_the_api_index_example_runs_as_printed_on_one_process():
    page = (ROOT / "docs" / "api" / "index.md").read_text()
    namespace = {"__name__": "__main__"}
    exec(compile(next(m.group(2) for m in FENCE.finditer(page) if m.group(1) == "python"), "api", "exec"), namespace)
    grace = namespace["grace"]
    try:
        assert grace.stats()["steps"] == 1 and 0 < grace.stats()["compression_ratio"] < 0.1
    finally:
        grace.close()
