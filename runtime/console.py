"""The rich consoles burst prints through: wrapped to the width of a terminal, never wrapped into a file or pipe
(rich would cut every line at 80 columns there, splitting sentences and paths that a reader greps for)."""

from __future__ import annotations

from rich.console import Console


def make_console(stderr: bool = False, **options) -> Console:
    """A Console for stdout (or stderr) that wraps its lines only when it writes to a terminal."""
    console = Console(stderr=stderr, **options)
    console.soft_wrap = not console.is_terminal
    return console
