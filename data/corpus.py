"""The embedded default corpus: the Python standard library's own source code.

It is on every machine that can run burst, it needs no download, and it is made of long real
documents (hundreds of files over 16K tokens). On first use it is prepared, with a 4,096-token
vocabulary trained on it (the vocabulary of the `debug` and `tiny` model presets), into
`$BURST_CACHE` (default `~/.cache/burst`) and reused afterwards. To train on your own data,
run `burst prepare` and point the trainer at the store it writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import stat
import sysconfig
from pathlib import Path

from data.prepare import prepare
from data.sources import looks_binary
from data.store import FORMAT_VERSION, METADATA_FILE
from runtime.directories import exclusive_writer
from runtime.failure import STORAGE_ERRORS, os_error_message

STDLIB_VOCAB_SIZE = 4096
# Part of the cache key: change it whenever the files chosen or the prepare options change.
CORPUS_OPTIONS: dict[str, object] = {"corpus": "stdlib-py", "revision": 2, "vocab_size": STDLIB_VOCAB_SIZE,
                                     "val_fraction": 0.01, "seed": 0, "format_version": FORMAT_VERSION}


def stdlib_sources() -> list[Path]:
    """Every UTF-8 .py file of this interpreter's standard library, its tests included; not site-packages.

    The few files that are not UTF-8 (encoding tests such as test/encoded_modules/module_koi8_r.py)
    are left out: `prepare` refuses such a file when it is named, as these are. So are symbolic links and
    whatever is not a regular file: Debian's and Ubuntu's Pythons link _sysconfigdata__linux_*.py to another file
    of the library (which `prepare` refuses as one file given twice) and sitecustomize.py to /etc.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    installed = {"site-packages", "dist-packages"}
    return sorted(p for p in stdlib.rglob("*.py")
                  if is_regular_file(p) and not installed & set(p.relative_to(stdlib).parts) and not looks_binary(p))


def is_regular_file(path: Path) -> bool:
    """Whether `path` is itself a regular file: not a symbolic link (to a file or not), a directory or a pipe."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where prepared default corpora live: `cache_dir`, else $BURST_CACHE, else ~/.cache/burst."""
    return Path(cache_dir or os.environ.get("BURST_CACHE") or Path.home() / ".cache" / "burst")


def default_store(cache_dir: str | Path | None = None, *, progress: bool = True) -> Path:
    """The token store of the standard-library corpus, prepared on first use (about 20 s on 2 cores).

    Safe to call from many processes at once (a trainer's ranks): one prepares, holding the store's
    writer lock (runtime/directories.py), while the others wait; then all reuse the same store.
    """
    stdlib = sysconfig.get_paths()["stdlib"]
    key = json.dumps({**CORPUS_OPTIONS, "stdlib": stdlib}, sort_keys=True)
    name = f"stdlib-{platform.python_version()}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    store_dir = cache_root(cache_dir) / name
    if (store_dir / METADATA_FILE).is_file():  # complete stores are only ever replaced whole: no lock to read one
        return store_dir
    try:
        # One caller prepares while the others wait; taking the lock removes what a killed prepare left.
        with exclusive_writer(store_dir, "store", wait=True):
            if not (store_dir / METADATA_FILE).is_file():
                prepare(stdlib_sources(), store_dir, vocab_size=CORPUS_OPTIONS["vocab_size"],
                        val_fraction=CORPUS_OPTIONS["val_fraction"], seed=CORPUS_OPTIONS["seed"], force=True,
                        progress=progress)
    except OSError as err:
        if err.errno not in STORAGE_ERRORS:
            raise
        raise ValueError(f"the default corpus cannot be prepared in the cache: {os_error_message(err)}; or set "
                         f"$BURST_CACHE to a writable directory, or pass a token store (--data)") from None
    return store_dir
