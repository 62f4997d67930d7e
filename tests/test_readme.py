"""README.md and the pages in docs/ stay navigable and true to the command line.

- README.md starts with its two copy-paste commands, one line each (.ci/run runs them): burst's main job, then
  the tests;
- it stays readable in one sitting: at most MAX_README_LINES lines, no section (a header's body, up to the next
  header of any level) past MAX_SECTION_LINES, each task shown by a command and a link to its page in docs/;
- its contents list is its ## and ### headers, in order;
- every page in docs/ can be reached from README.md by following links;
- every relative link, in README.md and docs/*.md, names a file that exists, and an anchor that exists in it;
- every `burst` command they show uses options that command has, and every `python benchmarks/X.py` command
  options its script declares; an option named in prose belongs to some command.

Plain text parsing, no torch: the `burst` options come from the Typer app (cli.py imports no torch).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main

import cli

REPO = Path(__file__).parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
MAX_README_LINES = 360
MAX_SECTION_LINES = 80
# Options of the other tools the pages show (pip, torchrun, docker, and ../shared/bench's harness), which
# prose may name too.
OTHER_TOOLS_OPTIONS = {"--no-deps", "--no-build-isolation", "--nnodes", "--nproc-per-node", "--rdzv-backend",
                       "--rdzv-endpoint", "--rdzv-id", "--no-python", "--max-restarts", "--gpus", "--ipc", "--impls",
                       "--seq", "--heads", "--dim", "--dtype", "--iters"}

FENCE = re.compile(r"^(```|~~~)")
HEADER = re.compile(r"^(#{1,6}) +(.+?) *#*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]+`")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def prose(path: Path) -> list[str]:
    """The file's lines, those inside fenced code blocks blanked (a `# comment` there is no header)."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return lines


def headers(path: Path) -> list[tuple[int, int, str]]:
    """(line index, level, title) of each header outside code blocks."""
    return [(i, len(m[1]), m[2]) for i, line in enumerate(prose(path)) if (m := HEADER.match(line))]


def slug(title: str) -> str:
    """GitHub's anchor for a header: lower case, punctuation (backticks, colons, commas, ...) dropped, spaces
    to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the file's headers (a repeated one gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for _, _, title in headers(path):
        base = slug(title)
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def relative_links(path: Path) -> list[str]:
    """The targets of the file's links and images that are not URLs (code spans and blocks left out)."""
    text = CODE_SPAN.sub("", "\n".join(prose(path)))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def bash_blocks(path: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)


def test_readme_starts_with_its_two_one_line_commands():
    """.ci/run runs the first two ```bash blocks as they are: each must be one line, and they are the first
    thing a reader meets, before any section."""
    text = README.read_text()
    blocks = bash_blocks(README)
    assert len(blocks) >= 2, "README.md must start with two ```bash blocks: install + train, install + test"
    for number, block in enumerate(blocks[:2], 1):
        assert "\n" not in block.strip(), f"README command {number} must be one line, got:\n{block}"
    first_section = min(i for i, level, _ in headers(README) if level == 2)
    second_block_end = text.index(blocks[1]) + len(blocks[1])
    assert text[:second_block_end].count("\n") < first_section, "the two commands come before any ## section"
    assert blocks[0].strip().endswith("burst train"), "README command 1 installs burst and runs `burst train`"
    assert blocks[1].strip().endswith("pytest -q"), "README command 2 installs the test tools and runs `pytest -q`"


def test_readme_is_short_enough_to_read_in_one_sitting():
    length = len(README.read_text().splitlines())
    assert length <= MAX_README_LINES, f"README.md has {length} lines, more than {MAX_README_LINES}: move the " \
                                       f"details to a page in docs/ and link to it"


def contents_list(path: Path) -> list[tuple[int, str, str]]:
    """(level, title, anchor) of each entry of the file's ## Contents list, its indentation giving the level."""
    found = headers(path)
    start = next(n for n, (_, level, title) in enumerate(found) if level == 2 and title == "Contents")
    end = found[start + 1][0] if start + 1 < len(found) else len(prose(path))
    return [(2 + len(m[1]) // 2, m[2], m[3]) for line in prose(path)[found[start][0] + 1:end]
            if (m := re.match(r"^( *)- \[(.+)\]\(#([^)]+)\)$", line))]


def test_contents_lists_every_section_in_order():
    expected = [(level, title, slug(title)) for _, level, title in headers(README)
                if level in (2, 3) and title != "Contents"]
    assert contents_list(README) == expected, "the ## Contents list must name every ## and ### section, in order, " \
                                              "nested"


def test_each_task_shows_a_command_and_links_its_page():
    """Under ## Tasks, every ### section holds a code block and links to the page in docs/ that says the rest."""
    found = headers(README)
    lines = README.read_text().splitlines()
    start = next(n for n, (_, level, title) in enumerate(found) if level == 2 and title == "Tasks")
    tasks = []
    for n in range(start + 1, len(found)):
        if found[n][1] <= 2:
            break
        end = found[n + 1][0] if n + 1 < len(found) else len(lines)
        tasks.append((found[n][2], "\n".join(lines[found[n][0] + 1:end])))
    assert len(tasks) >= 8, f"## Tasks shows {len(tasks)} tasks; train, extend, instruction- and preference-tune, " \
                            f"evaluate, convert, several machines and GPU each need one"
    for title, body in tasks:
        assert re.search(r"^```", body, re.M), f"task '{title}' shows no command"
        assert re.search(r"\]\(docs/[\w-]+\.md(#[\w-]+)?\)", body), f"task '{title}' links no page in docs/"


def test_every_page_in_docs_is_reachable_from_the_readme():
    reached, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for target in relative_links(page):
            file = target.partition("#")[0]
            linked = (page.parent / file).resolve()
            if file.endswith(".md") and linked.exists() and linked not in reached:
                reached.add(linked)
                todo.append(linked)
    orphans = sorted(str(page.relative_to(REPO)) for page in PAGES if page.resolve() not in reached)
    assert not orphans, f"pages no link from README.md leads to (link them from README.md or a page it links): " \
                        f"{orphans}"


def test_no_section_runs_past_max_section_lines():
    found = headers(README)
    ends = [i for i, _, _ in found[1:]] + [len(prose(README))]
    lengths = {title: end - i - 1 for (i, _, title), end in zip(found, ends, strict=True)}
    too_long = {title: length for title, length in lengths.items() if length > MAX_SECTION_LINES}
    assert not too_long, f"sections longer than {MAX_SECTION_LINES} lines (split them, or move measurements to " \
                         f"docs/): {too_long}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in relative_links(page):
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(REPO) if linked.is_relative_to(REPO) else linked}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no header with anchor #{anchor} in {linked.relative_to(REPO)}")
    assert not broken, f"broken links in {page.relative_to(REPO)}: {broken}"


def burst_options(hidden: bool = False) -> dict[str, set[str]]:
    """'train' -> {'--cp', ...}, 'bench attention' -> {...}: every `burst` command and its options; with `hidden`,
    the retired ones too, kept only to be refused by name (--val-sequences), which a command may not use."""
    def walk(command: Any, name: str) -> Iterator[tuple[str, set[str]]]:
        options = {option for p in command.params if hidden or not getattr(p, "hidden", False)
                   for option in (*p.opts, *p.secondary_opts)} | {"--help"}
        if hasattr(command, "commands"):  # a group (Typer's own click, not click's): burst --version
            yield name, options
            for sub_name, sub in command.commands.items():
                yield from walk(sub, f"{name} {sub_name}".strip())
        else:
            yield name, options
    return dict(walk(typer.main.get_command(cli.app), ""))


def script_options(script: Path) -> set[str]:
    """The options a benchmark script declares to argparse."""
    return set(re.findall(r"""["'](--[a-z0-9-]+)["']""", script.read_text())) | {"--help"}


def commands(page: Path) -> Iterator[str]:
    """Each command line of the page's ```bash blocks (continuation lines joined), and each code span in its
    prose that is a `burst ...` command."""
    for block in bash_blocks(page):
        yield from block.replace("\\\n", " ").splitlines()
    for span in CODE_SPAN.findall("\n".join(prose(page))):
        if span.startswith("`burst "):
            yield span.strip("`").replace("\n", " ")


def simple_commands(line: str) -> Iterator[list[str]]:
    """The words of each simple command of a shell line: split at && ; | ( ), quotes respected, comments
    dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    for token in lexer:
        if token and set(token) <= set("&;|()"):
            yield words
            words = []
        else:
            words.append(token)
    yield words


def unknown_options(line: str, burst: dict[str, set[str]]) -> list[str]:
    """The options a command line gives `burst` or a benchmark script that they do not have."""
    return [bad for words in simple_commands(line) for bad in unknown_in(words, burst)]


def unknown_in(words: list[str], burst: dict[str, set[str]]) -> list[str]:
    for n, word in enumerate(words):
        if word == "burst" and n + 1 < len(words) and re.fullmatch(r"[a-z][a-z-]*", words[n + 1]):
            name = words[n + 1] + (f" {words[n + 2]}" if words[n + 1] == "bench" and n + 2 < len(words) else "")
            if name not in burst:
                return [f"`burst {name}` is no command"]
            known, rest = burst[name], words[n + 1:]
            break
        if re.fullmatch(r"benchmarks/\w+\.py", word):
            script = REPO / word
            if not script.exists():
                return [f"{word} does not exist"]
            known, rest = script_options(script), words[n + 1:]
            break
    else:
        return []
    return [word for word in rest if word.startswith("--") and word.split("=")[0] not in known]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_commands_use_options_that_exist(page: Path):
    burst = burst_options()
    wrong = {command.strip(): bad for command in commands(page) if (bad := unknown_options(command, burst))}
    assert not wrong, f"{page.relative_to(REPO)} shows options its commands do not have: {wrong}"


def test_every_option_named_in_prose_exists():
    """An option named in a sentence (`--val-sequences` (8)) belongs to a `burst` command, a script in benchmarks/
    or scripts/, or one of the other tools the pages show: a renamed option cannot linger in the text."""
    known = set(OTHER_TOOLS_OPTIONS).union(*burst_options(hidden=True).values(),
                                           *map(script_options, (REPO / "benchmarks").glob("*.py")),
                                           *map(script_options, (REPO / "scripts").glob("*.py")))
    named = {option for page in PAGES for option in OPTION.findall("\n".join(prose(page)))}
    assert not named - known, f"options named in README.md or docs/ that no command has: {sorted(named - known)}"


def test_the_checks_catch_what_they_are_for(tmp_path: Path):
    """The parsers find a broken anchor, a header inside a code block is no header, and an unknown option or
    command is reported."""
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A `b`: c, d\n\n```bash\n# not a header\nburst train --cp 2\n```\n"
                    "[x](#a-b-c-d) [y](#missing) [z](https://example.com) `[w](#in-code)`\n")
    assert [title for _, _, title in headers(page)] == ["Title", "A `b`: c, d"]
    assert anchors(page) == {"title", "a-b-c-d"}
    assert relative_links(page) == ["#a-b-c-d", "#missing"]
    page.write_text("# T\n\n## Contents\n\n- [A](#a)\n  - [B c](#b-c)\n\n## A\n\n### B c\n")
    assert contents_list(page) == [(2, "A", "a"), (3, "B c", "b-c")]
    burst = burst_options()
    assert unknown_options("burst train --cp 2 --no-such-flag 3  # --comment", burst) == ["--no-such-flag"]
    assert unknown_options("burst trian --cp 2", burst) == ["`burst trian` is no command"]
    assert unknown_options("docker build -t burst .", burst) == []
    assert unknown_options("python benchmarks/step_modes.py --setting compile --bogus", burst) == ["--bogus"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_commands_start_from_a_run_with_init_from_and_eval_a_preference_store_without_passkeys(page: Path):
    """`--model` takes a preset or a model directory, and refuses a run (runs/...): a new stage from a run's
    weights is `--init-from RUN`; eval on a preference store (stores/prefs) refuses passkey flags, which it
    never reads."""
    wrong = [line.strip() for line in commands(page)
             if re.search(r"burst train .*--model runs/", line)
             or re.search(r"burst eval .*stores/prefs.*--passkey-", line)]
    assert not wrong, f"{page.relative_to(REPO)} shows commands burst refuses: {wrong}"


DURATION = re.compile(r"\b\d[\d,.]*\s?(?:s|min|minutes|seconds|hours?)\b")
TIMES = "docs/development.md#how-long-it-takes"  # the one place that says how long README's commands take


def clauses(path: Path, leaving_out: str | None = None) -> list[str]:
    """The page's prose cut into clauses (at '.' or ';' before a space, and at blank lines), indented transcripts
    and the section titled `leaving_out` left out."""
    kept, skipping = [], False
    for line in prose(path):
        if m := HEADER.match(line):
            skipping = m[2] == leaving_out
        if not skipping and not line.startswith("    "):
            kept.append(line)
    return [clause for paragraph in "\n".join(kept).split("\n\n") for clause in re.split(r"[.;]\s", paragraph)]


def test_how_long_the_readme_commands_take_is_said_in_one_place():
    """README.md's prose names no duration and links to the one table of measured times; no other page times
    README's commands or the test suite (figures that disagreed: 38 s, 49 s and 1 min 42 s for command 1), but
    the measurement pages the table cites as its sources."""
    assert f"({TIMES})" in README.read_text(), f"README.md links to {TIMES}"
    table_page = REPO / TIMES.partition("#")[0]
    assert TIMES.partition("#")[2] in anchors(table_page)
    said = [clause.strip() for clause in clauses(README) if DURATION.search(clause)]
    assert not said, f"README.md times things itself; say it in {TIMES} and link there: {said}"
    lines = prose(table_page)
    start = next(i for i, _, title in headers(table_page) if title == "How long it takes")
    end = next((i for i, _, _ in headers(table_page) if i > start), len(lines))
    sources = {(table_page.parent / target).resolve() for target in LINK.findall("\n".join(lines[start:end]))}
    for page in PAGES:
        if page.resolve() in sources:
            continue
        said = [clause.strip() for clause in clauses(page, leaving_out="How long it takes")
                if re.search(r"README|test suite|pytest -q", clause) and DURATION.search(clause)]
        assert not said, f"{page.relative_to(REPO)} times README's commands itself; say it in {TIMES}: {said}"


def test_the_readme_explains_doc_mask_where_it_first_shows_it():
    """A reader meets `--doc-mask` in a command; the same section's prose (or an earlier one) says what it does."""
    lines = README.read_text().splitlines()
    first_use = next(i for i, line in enumerate(lines) if "--doc-mask" in line)
    section_end = next((i for i, _, _ in headers(README) if i > first_use), len(lines))
    explained = [line for line in prose(README)[:section_end] if re.search(r"`--doc-mask` (lets|makes|keeps)", line)]
    assert explained, "README.md shows --doc-mask before saying what it does"
