"""Every package the installed code imports is one pyproject.toml declares: a required dependency, or, for an
import made only inside the function that needs it, an optional extra whose install line the file names.

Read from the source (ast), as tests/test_imports.py reads the project's own imports, so a new `import yaml`
anywhere in the installed packages fails here before it fails a user's fresh `pip install -e . && burst train`.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
from dataclasses import dataclass

import tomllib

from tests.test_packaging import REPO, installed_top_level, pyproject

# Import names whose distribution is not installed in the test environment (CUDA-only), or is named otherwise.
KNOWN_DISTRIBUTIONS = {"flash_attn": "flash-attn"}


def normalize(requirement: str) -> str:
    """'typer>=0.12' -> 'typer'; distribution names compare as PEP 503 normalizes them."""
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", requirement.strip())[0]).lower()


@dataclass(frozen=True)
class ThirdPartyImport:
    file: str
    line: int
    module: str  # the top-level import name: 'pyarrow' for `import pyarrow.parquet`
    at_module_level: bool


def third_party_imports(source: str, file: str, project: set[str]) -> list[ThirdPartyImport]:
    """The imports of `source` that are neither the standard library's nor the project's own."""
    tree = ast.parse(source, file)
    module_level = {id(node) for node in tree.body}
    module_level |= {id(inner) for node in tree.body if isinstance(node, (ast.If, ast.Try))  # guarded top-level
                     for inner in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in project:
                found.append(ThirdPartyImport(file, node.lineno, top, id(node) in module_level))
    return found


@functools.cache
def installed_distributions() -> dict[str, list[str]]:
    """import name -> distributions, read once: reading every installed package's metadata takes about a
    tenth of a second, and the scan asks for each of its hundreds of imports."""
    return importlib.metadata.packages_distributions()


def distribution_of(module: str) -> str:
    names = installed_distributions().get(module) or [KNOWN_DISTRIBUTIONS.get(module, module)]
    return normalize(names[0])


def undeclared(imports: list[ThirdPartyImport], sources: dict[str, str], metadata: dict) -> list[str]:
    """What a fresh install would lack, one line each: a module-level import of anything but a required
    dependency, or a lazy import of a package in no extra (or in one whose install line the file never names)."""
    required = {normalize(d) for d in metadata["project"]["dependencies"]}
    extras = {name: {normalize(d) for d in deps}
              for name, deps in metadata["project"].get("optional-dependencies", {}).items() if name != "dev"}
    problems = []
    for found in imports:
        distribution = distribution_of(found.module)
        if distribution in required:
            continue
        where = f"{found.file}:{found.line} imports {found.module} ({distribution})"
        if found.at_module_level:
            problems.append(f"{where} at start-up, but it is not in [project] dependencies")
            continue
        offering = [name for name, deps in extras.items() if distribution in deps]
        if not offering:
            problems.append(f"{where}, which no extra of pyproject.toml offers")
        elif not any(f"burst-attention[{name}]" in sources[found.file] for name in offering):
            problems.append(f"{where} from the extra {offering[0]!r}, but the file never tells the user "
                            f"to pip install 'burst-attention[{offering[0]}]'")
    return problems


def installed_sources() -> dict[str, str]:
    """relative path -> text of every .py file pip installs."""
    sources = {}
    for top in installed_top_level():
        paths = [REPO / top] if top.endswith(".py") else sorted((REPO / top).rglob("*.py"))
        for path in paths:
            sources[str(path.relative_to(REPO))] = path.read_text()
    return sources


def project_names() -> set[str]:
    return {top.removesuffix(".py") for top in installed_top_level()}


def test_every_import_of_the_installed_code_is_a_declared_dependency():
    sources = installed_sources()
    imports = [found for file, text in sources.items() for found in third_party_imports(text, file, project_names())]
    assert {"torch", "typer", "tokenizers", "jinja2"} <= {found.module for found in imports}  # the scan sees them
    assert undeclared(imports, sources, pyproject()) == []


def test_an_undeclared_import_fails_the_check():
    """The check itself: the defect this test exists for (tokenizers and jinja2 imported, not declared)."""
    source = ("import torch\nimport tokenizers\n\ndef plot():\n    import matplotlib\n\n"
              "def parquet():\n    import pyarrow  # pip install 'burst-attention[parquet]'\n")
    sources = {"data/x.py": source}
    imports = third_party_imports(source, "data/x.py", project_names())
    metadata = tomllib.loads('[project]\ndependencies = ["torch>=2.6"]\n'
                             '[project.optional-dependencies]\nplot = ["matplotlib"]\nparquet = ["pyarrow"]\n')
    assert undeclared(imports, sources, metadata) == [
        "data/x.py:2 imports tokenizers (tokenizers) at start-up, but it is not in [project] dependencies",
        "data/x.py:5 imports matplotlib (matplotlib) from the extra 'plot', but the file never tells the user "
        "to pip install 'burst-attention[plot]'",
    ]
    guarded = "try:\n    import yaml\nexcept ImportError:\n    yaml = None\n"
    assert [f.at_module_level for f in third_party_imports(guarded, "x.py", set())] == [True]
