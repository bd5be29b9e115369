"""Imports point one way (architecture.md): each rule names a package and the imports it must
not make, read from the source with ``ast`` (lazy imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (files, forbidden module prefixes, why)
RULES = [
    ("loaders", ("qserve",), "loaders read checkpoints; they never import the engine"),
    ("quant_kernels", ("qserve", "loaders"), "the numeric core imports nothing else of this repo"),
    ("qserve/scheduler", ("torch",), "the scheduler and block pool are pure Python"),
    (
        "qserve/distributed",
        ("qserve.engine", "qserve.server", "qserve.commands"),
        "process groups and sharded layers sit below the engine (the launcher is engine/tensor_parallel.py)",
    ),
    ("qserve/config.py", ("qserve.model",), "config reads Llama-family configs; the registry translates the rest"),
    ("qserve/model/families", ("qserve.model.registry",), "adapters take their base from model/adapter.py"),
    ("qserve/server/route_support.py", ("qserve.server.app",), "the app includes the routes, not the reverse"),
    (
        "qserve/engine/core",
        ("qserve.server", "fastapi", "starlette", "uvicorn"),
        "the engine core and its client know no HTTP (the server uses them as it uses AsyncEngine)",
    ),
    ("qserve/spec_decode/config.py", ("torch", "qserve.engine"), "serve checks --speculative-config before torch"),
    ("qserve/spec_decode/ngram.py", ("torch", "qserve.engine", "qserve.runner"), "n-gram lookup is pure Python"),
]


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def _files(place: str) -> list[Path]:
    path = ROOT / place
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


@pytest.mark.parametrize(("place", "forbidden", "why"), RULES, ids=[rule[0] for rule in RULES])
def test_imports_point_one_way(place: str, forbidden: tuple[str, ...], why: str) -> None:
    files = _files(place)
    assert files, f"{place} has no Python files: the rule checks nothing"
    offences = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in files
        for line, name in _imports(path)
        if any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden)
    ]
    assert not offences, f"{why}:\n" + "\n".join(offences)


def test_the_rule_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The reader finds plain, from- and function-local imports (a rule that cannot fail proves nothing)."""
    source = tmp_path / "m.py"
    source.write_text("import torch\nfrom qserve.engine import engine\n\ndef f():\n    import qserve.server.app\n")
    names = [name for _, name in _imports(source)]
    assert names == ["torch", "qserve.engine.engine", "qserve.server.app"]
