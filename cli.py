"""The `burst` command line: a thin Typer layer over plain functions in burst/, models/, data/.

Each command parses flags, builds a config and calls one function; no logic lives here.
"""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False,
                  help="Long-context LLaMA training with exact BurstAttention sequence parallelism.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks.")
app.add_typer(bench_app, name="bench")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
