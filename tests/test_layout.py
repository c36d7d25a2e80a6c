"""The layout docs/architecture.md describes, checked on the source: layers import downwards only
(launch -> mdl -> (models, datamodules) -> erasure), no import cycle among our modules (imports inside
functions included), and no module so long that a newcomer cannot read it in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("erasure", "models", "datamodules", "mdl")
MAX_LINES = 400
ALLOWED = {  # package -> the packages of ours it may import
    "erasure": {"erasure"},
    "models": {"models"},
    "datamodules": {"datamodules", "erasure"},
    "mdl": {"mdl", "models", "datamodules", "erasure"},
}


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _imports() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere in its file."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            deps = set()
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [node.module]
                    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    else ([a.name for a in node.names] if isinstance(node, ast.Import) else [])
                )
                deps |= {n for n in names if n.split(".")[0] in PACKAGES}
            found[_module_name(path)] = deps
    return found


def test_layers_import_downwards_only() -> None:
    wrong = [(m, d) for m, deps in _imports().items() for d in deps if d.split(".")[0] not in ALLOWED[m.split(".")[0]]]
    assert not wrong, f"imports against the layers (docs/architecture.md): {wrong}"


def test_no_import_cycles() -> None:
    imports = _imports()

    def known(name: str) -> str | None:  # `from mdl.report import x` names a package (its __init__)
        while name not in imports and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in imports else None

    graph = {m: {k for d in deps if (k := known(d)) and k != m} for m, deps in imports.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d) :] + [d])
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"


def test_no_module_is_too_long() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for package in PACKAGES
        for p in (REPO / package).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"
