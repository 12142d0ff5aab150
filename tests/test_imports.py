"""The import graph: no circles in paged/ and kernels/ (every import counts: module-level,
type-only and lazy ones inside functions, which defer loading but still tie two modules to each
other), and the core stays light. The other architecture rules are in tests/test_architecture.py."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("paged", "kernels")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _module_level_imports(tree: ast.Module):
    """Import nodes executed at import time: the module body, descending into if/try/with
    blocks (``if TYPE_CHECKING:`` included) but not into functions or classes' methods."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []) or [])
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)


def _all_imports(tree: ast.Module):
    """Every import node, wherever it is (functions and methods included: lazy imports)."""
    return (n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))


def import_graph(lazy: bool = True) -> dict[str, set[str]]:
    """Module -> modules of ours it imports; ``lazy=False``: only what runs at import time."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    imports = _all_imports if lazy else _module_level_imports
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    prefix = ".".join(base[:len(base) - node.level + 1])
                    src = f"{prefix}.{node.module}" if node.module else prefix
                else:
                    src = node.module or ""
                # `from pkg import sub` names a submodule when one exists, else a name in pkg
                targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a module outside ours -> ignore
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_edge(a: str, b: str) -> bool:
    """A package importing its own submodules and a submodule importing a name its package
    re-exports form the usual package/submodule pair, not a design circle."""
    return a.startswith(b + ".") or b.startswith(a + ".")


def test_no_import_cycles():
    """No circle among our modules, counting every import (lazy ones inside functions too)."""
    graph = import_graph()
    assert "paged.core.block_pool" in graph and "kernels" in graph
    assert "paged.core.snapshot" in graph["paged.core.kv_manager"]  # a lazy import is an edge
    assert "paged.core.snapshot" not in import_graph(lazy=False)["paged.core.kv_manager"]
    pruned = {m: {t for t in ts if not _is_package_edge(m, t)} for m, ts in graph.items()}
    cycles = _cycles(pruned)
    assert not cycles, f"import circles (lazy imports inside functions included): {cycles}"


def test_the_cycle_check_sees_lazy_imports():
    """The check itself: an import inside a method is an edge, and two modules importing each
    other (one lazily) are reported."""
    tree = ast.parse("import a\nclass K:\n    def f(self):\n        from . import b\n")
    assert [len(n.names) for n in _all_imports(tree)] == [1, 1]
    assert len(list(_module_level_imports(tree))) == 1
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_core_imports_no_torch_pandas_or_plotly():
    code = ("import sys, paged.core, paged.telemetry; "
            "print(','.join(m for m in ('torch', 'pandas', 'plotly', 'numpy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    loaded = set(filter(None, r.stdout.strip().split(",")))
    assert not loaded & {"torch", "pandas", "plotly"}, f"import paged.core loaded {sorted(loaded)}"


def test_only_paged_viz_imports_plotly_or_ipywidgets():
    """The layout rule: figures and widgets live in ``paged/viz/`` (lazy imports inside functions too)."""
    import ast

    offenders = []
    for path in sorted((ROOT / "paged").rglob("*.py")):
        if (ROOT / "paged" / "viz") in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] in ("plotly", "ipywidgets", "anywidget")]
    assert not offenders, f"plotly/ipywidgets imported outside paged/viz: {offenders}"


def _imports_in_file(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a file, lazy ones inside functions included."""
    base = list(path.relative_to(ROOT).parts[:-1])  # the package a relative import starts from
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = ".".join(base[:len(base) - node.level + 1])
                src = f"{prefix}.{node.module}" if node.module else prefix
            else:
                src = node.module or ""
            out += [(node.lineno, f"{src}.{a.name}") for a in node.names]
    return out


def _offenders(files, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{line} {name}" for p in files for line, name in _imports_in_file(p)
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


def test_studies_sit_above_the_executors_and_below_the_views():
    """Data flows one way: executors -> records -> studies -> views. Nothing below paged.studies
    imports it (lazily either), a study never imports a view, and paged.cli is the one caller above."""
    below = [p for p in sorted((ROOT / "paged").rglob("*.py"))
             if not {"studies", "viz"} & set(p.relative_to(ROOT / "paged").parts) and p.name != "cli.py"]
    below += sorted((ROOT / "kernels").rglob("*.py"))
    assert len(below) > 50
    bad = _offenders(below, ("paged.studies", "paged.viz"))
    assert not bad, f"modules below paged.studies import a study or a view: {bad}"
    studies = sorted((ROOT / "paged" / "studies").rglob("*.py"))
    assert len(studies) > 10
    bad = _offenders(studies, ("paged.viz",))
    assert not bad, f"studies import views (a study returns frames; paged.viz draws them): {bad}"


def test_views_run_no_executor():
    """paged.viz draws frames, snapshots and study results: it never imports an executor or the
    runs that step one (lazy imports included). Running is a study's job (paged.studies)."""
    views = sorted((ROOT / "paged" / "viz").rglob("*.py"))
    bad = _offenders(views, ("paged.engine", "paged.sim.simulator", "paged.runs"))
    assert not bad, f"views import an executor; move the runner to paged/studies/: {bad}"


def test_kernels_import_nothing_of_paged():
    """The kernels are a library of their own (tensors in, tensors out): no module in ``kernels/``
    imports ``paged`` (lazily either); ``paged`` imports ``kernels``, never the other way."""
    files = sorted((ROOT / "kernels").rglob("*.py"))
    assert len(files) > 10
    bad = _offenders(files, ("paged",))
    assert not bad, f"kernels import paged: {bad}"


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds at import time (defs, classes, assignments, imports)."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []) or [])
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
    return names


def test_every_name_in___all___is_defined():
    """``from m import *`` works: each literal ``__all__`` entry is bound in the module (or the
    module resolves names lazily with a module-level ``__getattr__``)."""
    missing = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        bound = _bound_names(tree)
        if "__getattr__" in bound:
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                try:
                    listed = ast.literal_eval(node.value)
                except ValueError:
                    continue  # computed (e.g. sorted(...)): not checked here
                missing += [f"{name}.{n}" for n in listed if n not in bound]
    assert not missing, f"__all__ names that the module does not define: {missing}"
