"""What gets installed: the Dockerfile copies every package and module pyproject.toml installs, and the
distribution keeps `import burst` and the `burst` command under its own name."""

from __future__ import annotations

import shlex
from pathlib import Path

import tomllib
from setuptools import find_namespace_packages, find_packages

REPO = Path(__file__).parents[1]


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def installed_top_level() -> set[str]:
    """The top-level packages and modules (as files: cli.py) pip installs, found as setuptools finds them."""
    setuptools = pyproject()["tool"]["setuptools"]
    find = setuptools["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages
    packages = finder(where=str(REPO), include=find.get("include", ["*"]), exclude=find.get("exclude", ()))
    return {name.partition(".")[0] for name in packages} | {f"{module}.py" for module in setuptools["py-modules"]}


def copied(dockerfile: str) -> set[str]:
    """What the Dockerfile's COPY instructions take from the build context (the sources, not the destinations)."""
    sources = set()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            words = shlex.split(line.split("#")[0])
            sources.update(word.rstrip("/") for word in words[1:-1] if not word.startswith("--"))
    return sources


def test_the_dockerfile_copies_every_package_pyproject_installs_and_nothing_else():
    needed = installed_top_level() | {"pyproject.toml", pyproject()["project"]["readme"]}
    assert {"burst", "runtime", "data", "models", "checkpoints", "trainer", "evaluation", "bench", "cli.py"} <= needed
    assert copied((REPO / "Dockerfile").read_text()) == needed


def test_a_forgotten_package_is_seen():
    dockerfile = ("FROM x\nCOPY pyproject.toml README.md cli.py ./\nCOPY burst burst  # the library\n"
                  "COPY --chown=1 data data/\n")
    assert copied(dockerfile) == {"pyproject.toml", "README.md", "cli.py", "burst", "data"}
    assert installed_top_level() - copied(dockerfile) >= {"runtime", "checkpoints", "bench"}


def test_only_real_packages_are_installed():
    assert "benchmarks" not in installed_top_level() and "tests" not in installed_top_level()
    for package in installed_top_level() - {"cli.py"}:
        assert (REPO / package / "__init__.py").is_file()


def test_the_distribution_has_a_name_of_its_own_and_keeps_the_command():
    project = pyproject()["project"]
    assert project["name"] == "burst-attention"  # `burst` on PyPI is another project
    assert project["scripts"] == {"burst": "cli:main"} and "burst" in installed_top_level()
