"""The package's import structure tells the truth: the graph of every import of a hetero module
(at module level, inside functions and under ``TYPE_CHECKING`` alike, found with ``ast``) has no
cycle, no hetero module is imported inside a function (where it would hide one), and no
``__init__.py`` holds logic."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "hetero"

def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        rel = f.relative_to(PACKAGE.parent).with_suffix("")
        out[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> dict[str, bool]:
    """The hetero modules ``name`` imports, each mapped to whether only inside a function."""
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for t in targets:
            if t in modules and t != name and not name.startswith(t + "."):
                out[t] = out.get(t, True) and id(node) in nested
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    modules = _modules()
    graph = {m: set(_imports(m, f, modules)) for m, f in modules.items()}
    assert sum(len(v) for v in graph.values()) > 300  # (the graph was found: hetero imports itself a lot)
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_hetero_module_is_imported_inside_a_function():
    modules = _modules()
    inside = sorted((m, t) for m, f in modules.items() for t, nested in _imports(m, f, modules).items() if nested)
    assert inside == [], f"imports inside functions (move them to the module's imports): {inside}"


def test_no_init_module_holds_logic():
    for init in PACKAGE.rglob("__init__.py"):
        body = ast.parse(init.read_text()).body
        logic = [type(n).__name__ for n in body if not isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr, ast.Assign))]
        assert logic == [], f"{init.relative_to(PACKAGE)} holds {logic}: move it into a module of its own"
