"""Settings the user gave that do not apply: refused, not silently ignored.

`burst train` and `burst eval` know which settings the user set (flags, and for training its config file's keys);
each knows which of its settings a run of this kind would never read. A setting given and never read is a
mistake the user should hear of before any work (a --simpo-gamma with dpo, a --val-every on a preference run).
"""

from __future__ import annotations

from collections.abc import Iterable


def refuse_ignored(given: Iterable[str] | dict[str, str], ignored: dict[str, str]) -> None:
    """Refuse the first setting named in `given` that `ignored` maps to why it does not apply, in one line.
    given: the settings' names, or each name mapped to how the user gave it (default: its flag)."""
    named = given if isinstance(given, dict) else {name: "--" + name.replace("_", "-") for name in given}
    for name, why in ignored.items():
        if name in named:
            raise ValueError(f"{named[name]} {why}; drop it")
