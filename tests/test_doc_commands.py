"""The commands README.md and docs/ show, taken as a reader copies them, against the real command line.

- Every `burst ...` command of their code blocks (```bash blocks, continuation lines joined, and the lines of
  indented blocks that start with `burst `) parses on the Typer app's own click command: the command exists,
  every option exists and is not a retired one, every value has the option's type, required arguments are there.
  Nothing runs: click's `make_context` parses and converts, as `burst` would before calling the command.
- A ```bash block continues its lines correctly: no `\\` followed by spaces, none on a block's last line or after
  a `# comment` (which would swallow the next line), and no line of options that continues nothing.
- The cheap ones run end to end in a temporary directory and exit 0: `burst --version`, `burst --help` and each
  command's `--help`, every `burst plan` command shown (seconds each), every `burst bench attention --plan-only
  --window` one (counts, no kernel), and README's `burst prepare docs/ --out store`. The rest train, evaluate or
  read stores and models the pages make first (`runs/long`, `$SMOL`), which the slower tests cover on stand-ins.

Notation the pages use, read as a reader would (no command is skipped):
- `[--beta 0.1]`: an optional part, parsed as if given;
- a trailing `...` word: "more options", dropped;
- `$(command)`: a shell substitution, read as one word; `$NAME` stays a word.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main
from typer._click import ClickException  # Typer's own copy of click, whose errors its commands raise
from typer.testing import CliRunner

import cli

REPO = Path(__file__).parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)")


def bash_blocks(text: str) -> Iterator[tuple[int, list[str]]]:
    """(first line number, lines) of each ```bash block of a page's text."""
    block, start = None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            if block is None and line.strip() == "```bash":
                block, start = [], number + 1
            elif block is not None:
                yield start, block
                block = None
        elif block is not None:
            block.append(line)


def continuation_faults(text: str) -> list[str]:
    """The broken continuations of a page's ```bash blocks, each as 'line N: what is wrong'."""
    faults = []
    for start, lines in bash_blocks(text):
        for offset, line in enumerate(lines):
            number, continued = start + offset, offset > 0 and lines[offset - 1].endswith("\\")
            if re.search(r"\\[ \t]+$", line):
                faults.append(f"line {number}: spaces after the continuation's \\ (the shell reads an escaped space "
                              f"and ends the command)")
            elif line.endswith("\\") and offset == len(lines) - 1:
                faults.append(f"line {number}: the block's last line ends with \\ and continues into nothing")
            elif line.endswith("\\") and shlex.split(line[:-1], comments=True) != shlex.split(line[:-1]):
                faults.append(f"line {number}: a \\ after a # comment joins the next line into the comment")
            if not continued and re.match(r"\s*--?[a-z]", line):
                faults.append(f"line {number}: options that continue no command (the line before lacks its \\)")
    return faults


def code_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, command line) of every command a page shows: each ```bash block's lines with their
    continuations joined, and each line of an indented block that starts with `burst `."""
    fenced = False
    for start, lines in bash_blocks(text):
        joined, first = "", start
        for offset, line in enumerate(lines):
            if not joined:
                first = start + offset
            if line.endswith("\\"):
                joined += line[:-1] + " "
                continue
            yield first, joined + line
            joined = ""
        if joined:
            yield first, joined
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and re.match(r" {4,}burst [a-z]", line):
            yield number, line.strip()


def without_substitutions(line: str) -> str:
    """The line with each `$(...)` (parentheses inside it balanced) replaced by one word."""
    while (start := line.find("$(")) >= 0:
        depth, end = 0, start + 1
        for end in range(start + 1, len(line)):
            depth += {"(": 1, ")": -1}.get(line[end], 0)
            if depth == 0:
                break
        line = line[:start] + "SUBSTITUTED" + line[end + 1:]
    return line


def burst_arguments(line: str) -> Iterator[list[str]]:
    """The arguments after `burst` of each `burst ...` command in a shell line (after `&&`, `torchrun ...
    --no-python`, `docker run ... IMAGE`), the pages' notation read (the module's docstring)."""
    lexer = shlex.shlex(without_substitutions(line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: list[str] = []
    for token in [*lexer, ";"]:
        if token and set(token) <= set("&;|()"):
            # `burst` then a command or an option (not `docker build -t burst .`, where it names an image)
            starts = [n for n, word in enumerate(words[:-1]) if word == "burst" and re.match(r"-*[a-z]", words[n + 1])]
            if starts:
                yield [word.strip("[]") for word in words[starts[0] + 1:] if word != "..."]
            words = []
        else:
            words.append(token)


APP = typer.main.get_command(cli.app)


def parse_error(arguments: list[str]) -> str | None:
    """Why `burst ARGUMENTS` would not parse (None: it parses), without running the command."""
    command, name, rest = APP, "burst", list(arguments)
    while hasattr(command, "commands") and rest and not rest[0].startswith("-"):
        if rest[0] not in command.commands:
            return f"`{name} {rest[0]}` is no command"
        name, command, rest = f"{name} {rest[0]}", command.commands[rest[0]], rest[1:]
    retired = {option for p in command.params if getattr(p, "hidden", False) for option in p.opts}
    if given := [word for word in rest if word.split("=")[0] in retired]:
        return f"{given[0]} is retired (kept only to be refused)"
    try:
        with command.make_context(name, rest):
            pass
    except typer.Exit:  # an eager --help or --version: parsed
        return None
    except ClickException as err:
        return f"{name}: {err.format_message()}"
    return None


def page_faults(text: str) -> list[str]:
    """Every fault of a page's commands: broken continuations, and `burst` commands that do not parse."""
    faults = continuation_faults(text)
    for number, line in code_lines(text):
        for arguments in burst_arguments(line):
            if (error := parse_error(arguments)) is not None:
                faults.append(f"line {number}: {error}")
    return faults


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO)))
def test_every_command_a_page_shows_parses(page: Path):
    faults = page_faults(page.read_text())
    assert not faults, f"{page.relative_to(REPO)} shows commands burst would refuse: {faults}"


def test_the_pages_show_commands_of_every_kind():
    """The extraction finds the commands (a regex that matched nothing would pass every page)."""
    shown = {arguments[0] for page in PAGES for _, line in code_lines(page.read_text())
             for arguments in burst_arguments(line) if arguments}
    assert {"train", "prepare", "eval", "generate", "plan", "convert-checkpoint", "bench"} <= shown, shown


def test_the_check_finds_what_it_is_for():
    """A synthetic page: each fault is found, and the same commands written right pass."""
    good = ("```bash\nburst train --model tiny \\\n    --seq-len 2048 --cp 2   # two ranks\n"
            "torchrun --nnodes 1 --no-python burst train --dp 2 && burst eval --checkpoint runs/x [--cp 2] ...\n"
            "burst convert-checkpoint $(python scripts/gemma3.py) out --to burst\n```\n\n"
            "    burst plan --gpu h100 --seq-len max\n")
    assert page_faults(good) == []
    faults = {
        "```bash\nburst train --model tiny --no-such-flag 3\n```\n": "No such option: --no-such-flag",
        "```bash\nburst train --cp two\n```\n": "Invalid value for '--cp'",
        "```bash\nburst trian --cp 2\n```\n": "`burst trian` is no command",
        "```bash\nburst prepare docs/\n```\n": "Missing option '--out'",
        "```bash\nburst convert-checkpoint a --to hf\n```\n": "Missing argument 'dst'",
        "```bash\nburst train --val-sequences 8\n```\n": "--val-sequences is retired",
        "```bash\nburst train --model tiny \\ \n    --cp 2\n```\n": "spaces after the continuation",
        "```bash\nburst train --model tiny\n    --cp 2\n```\n": "options that continue no command",
        "```bash\nburst train --model tiny  # tiny \\\n    --cp 2\n```\n": "joins the next line into the comment",
        "```bash\nburst train --model tiny \\\n```\n": "continues into nothing",
        "```bash\nburst train --model tiny \\\n    --cp\n```\n": "Option '--cp' requires an argument",
        "    burst plan --gpus 8\n": "No such option: --gpus",
    }
    for page, fault in faults.items():
        found = page_faults(page)
        assert any(fault in line for line in found), (page, found)


def shown_commands(first: str, *also: str) -> list[list[str]]:
    """The arguments of every `burst FIRST ...` command the pages show that also holds each of `also`."""
    shown = {tuple(arguments) for page in PAGES for _, line in code_lines(page.read_text())
             for arguments in burst_arguments(line)
             if arguments[:1] == [first] and all(word in arguments for word in also)}
    return [list(arguments) for arguments in sorted(shown)]


# README's first store, of the pages in docs/ (seconds: a tokenizer trained on them, then their tokens)
SHOWN_AND_CHEAP = [["prepare", "docs/", "--out", "store"]]
CHEAP = [["--help"], *[[name, "--help"] for name in APP.commands if name != "bench"], ["bench", "attention", "--help"],
         *shown_commands("plan"), *shown_commands("bench", "--plan-only", "--window"), *SHOWN_AND_CHEAP]


def test_the_chosen_commands_are_still_shown():
    assert all(arguments in shown_commands(arguments[0]) for arguments in SHOWN_AND_CHEAP), SHOWN_AND_CHEAP


@pytest.mark.parametrize("arguments", CHEAP, ids=" ".join)
def test_the_cheap_commands_run(arguments: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Run in a temporary directory (a --json file lands there) with its own cache (the CPU's matmul rate)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").symlink_to(REPO / "docs")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("BURST_CACHE", str(tmp_path / "cache" / "burst"))
    monkeypatch.delenv("BURST_DEVICE", raising=False)
    result = CliRunner().invoke(cli.app, arguments)
    assert result.exit_code == 0, f"burst {' '.join(arguments)} exited {result.exit_code}:\n{result.output}"
    assert len(CHEAP) >= 8, "the pages show a `burst plan` command, or this test runs only --help"


def test_burst_version_runs_as_a_command():
    """As the console script runs it: a process of its own, exit 0, its version on stdout."""
    done = subprocess.run([sys.executable, "-m", "cli", "--version"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("burst "), done
