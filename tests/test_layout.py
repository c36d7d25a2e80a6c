"""The layout docs/architecture.md describes, checked on the source: layers import downwards only
(launch -> mdl -> (models, datamodules) -> erasure), no import cycle among our modules (imports inside
functions included), no module so long that a newcomer cannot read it in one sitting, and no long public function
without a docstring saying what it is for."""

from __future__ import annotations

import ast
import io
import re
import tokenize
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


# Inside mdl/, from the bottom: the shared modules at its root (code lengths, the schedule, results), the engine that
# trains a run's members, run/ that turns a config into a run, sweeps/ that looks at a sweep before it runs, report/
# that reads finished runs, and mdl.runs, the command over the run store.
MDL_LAYERS = ("mdl", "mdl.engine", "mdl.run", "mdl.sweeps", "mdl.report", "mdl.runs")


def mdl_layer(module: str) -> int:
    """The index in MDL_LAYERS of an mdl module's layer (the longest prefix that names one)."""
    return max(i for i, layer in enumerate(MDL_LAYERS) if module == layer or module.startswith(layer + "."))


def test_the_layers_inside_mdl_import_downwards_only() -> None:
    assert mdl_layer("mdl.codelength") == 0 and mdl_layer("mdl.report.build") == 4 and mdl_layer("mdl.runs") == 5
    wrong = [
        (m, d)
        for m, deps in _imports().items()
        if m.startswith("mdl")
        for d in deps
        if d.startswith("mdl") and mdl_layer(d) > mdl_layer(m)
    ]
    assert not wrong, f"imports up the layers inside mdl/ (docs/architecture.md): {wrong}"


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


def reading_lines(text: str) -> int:
    """Lines a reader reads, however the formatter lays them out: every physical line but those that only continue
    a bracketed expression (ruff format puts each item of a long call or list on its own line); comment lines and
    a string's lines count."""
    continuing, depth, last_row = set(), 0, 0
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        start_row = token.start[0]
        if start_row > last_row and depth > 0 and token.type not in (tokenize.COMMENT, tokenize.STRING):
            continuing.add(start_row)
        last_row = max(last_row, token.end[0])
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
    return len(text.splitlines()) - len(continuing)


def test_reading_lines_ignore_the_formatters_layout() -> None:
    one = "x = f(a, b)  # why\n"
    split = "x = f(\n    a,\n    b,\n)  # why\n"
    assert reading_lines(one) == reading_lines(split) == 1
    assert (
        reading_lines('"""a\nb"""\n# c\ny = [\n    1,  # one\n]\n') == 4
    )  # a docstring's lines and a comment line count


def test_no_module_is_too_long() -> None:
    long = {
        str(p.relative_to(REPO)): n
        for package in PACKAGES
        for p in (REPO / package).rglob("*.py")
        if (n := reading_lines(p.read_text())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} reading lines (split them by concern): {long}"


DOCSTRING_LINES = 15  # a public function longer than this says what it is for and why


def _sources() -> list[Path]:
    """Every file of ours: the packages, the packed launchers (hydra_plugins/) and the entry point."""
    return [p for d in (*PACKAGES, "hydra_plugins") for p in (REPO / d).rglob("*.py")] + [REPO / "launch.py"]


def test_long_public_functions_have_docstrings() -> None:
    bare = [
        f"{p.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for p in _sources()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and not node.name.startswith("_")
        and node.end_lineno - node.lineno + 1 > DOCSTRING_LINES
        and ast.get_docstring(node) is None
    ]
    assert not bare, f"public functions over {DOCSTRING_LINES} lines without a docstring (what it is for, why): {bare}"


NAMED = re.compile(r"(?<![\w./])(?:erasure|models|datamodules|mdl|hydra_plugins)(?:\.[A-Za-z_]\w*)+")


def _top_level_names(path: Path) -> set[str]:
    """What a module defines at its top level, classes' methods as ``Class.method``."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, ast.FunctionDef)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def unresolved(reference: str) -> str | None:
    """Why a dotted name of ours in the source (``mdl.run.identity.config_hash``) names nothing, or None when it names
    a module, or a module and something it defines. ``mdl.`` and a name that is no module of mdl/ is a config key
    (``mdl.members_per_fit``), not code."""
    parts = reference.split(".")
    module = None
    for i in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:i])
        found = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if found.is_file():
            module = (i, found)
            break
    if module is None or module == (1, REPO / "mdl" / "__init__.py"):  # mdl.<key>: the config's mdl node
        return None
    i, path = module
    rest = ".".join(parts[i:])
    if not rest or rest.split(".")[0] in _top_level_names(path):  # a name it defines, or an attribute of one
        return None
    return f"{reference}: {'.'.join(parts[:i])} defines no {rest}"


def test_the_code_the_source_names_exists() -> None:
    """Comments and docstrings name our code by dotted name (mdl.run.identity.config_hash), and every such name
    resolves: the map a newcomer reads does not point at code that moved or was renamed."""
    assert unresolved("mdl.run.identity.config_hash") is None and unresolved("mdl.members_per_fit") is None
    assert unresolved("mdl.run.identity.no_such_function") is not None and unresolved("datamodules.no_such") is not None
    stale = sorted(
        {
            f"{p.relative_to(REPO)}: {why}"
            for p in _sources()
            for m in NAMED.finditer(p.read_text())
            if (why := unresolved(m.group(0).rstrip(".")))
        }
    )
    assert not stale, "\n".join(stale)


MAX_INIT_PARAMETERS = 10


def test_no_hand_written_init_takes_more_than_ten_parameters() -> None:
    """A class that needs more is carrying a run's settings one by one: give it the record that holds them
    (``mdl.engine.fitting.Run`` and ``Fitting``, ``datamodules.options.DataOptions``). Dataclasses' own ``__init__``
    are records, not hand-written, and are not counted."""
    wide = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                a = node.args
                count = len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                if count > MAX_INIT_PARAMETERS:
                    wide.append(f"{path.relative_to(REPO)}:{node.lineno} ({count})")
    assert not wide, f"__init__ with more than {MAX_INIT_PARAMETERS} parameters: {wide}"
