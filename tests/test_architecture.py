"""The architecture's rules over the AST of every module in ``paged/`` and ``kernels/``: state is
private to its owner (no module reads or writes another class's private attributes). The import
rules (no circle, lazy imports included; a light core) are in ``tests/test_imports.py``."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("paged", "kernels")
MAX_LINES = 400

# Third-party names that start with "_" yet are what the library offers for the purpose, each
# allowed in the one file that needs it: (file, attribute) -> why.
THIRD_PARTY_PRIVATE = {
    ("kernels/api.py", "_version"): "torch.Tensor._version: the in-place version counter (no public "
                                    "equivalent) tells a cached plan that its tensors were written",
    ("paged/models/packed.py", "_version"): "torch.Tensor._version, as above (packed weights go stale)",
    ("paged/models/packed.py", "_reorder_linear_weight"): "a torch.ops.mkldnn operator's own name",
    ("paged/models/packed.py", "_linear_pointwise"): "a torch.ops.mkldnn operator's own name",
    ("kernels/kivi_cache.py", "_replace"): "namedtuple's public API (the underscore avoids field clashes)",
}


def _files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(cls: ast.ClassDef) -> set[str]:
    """Private names class ``cls`` defines: assigned on ``self``/``cls`` in its methods, bound in
    its body (attributes, methods) or listed in its ``__slots__``."""
    names: set[str] = set()
    for node in cls.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Name):
                names.add(t.id)
                if t.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                    names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and _is_self(sub.value):
                    names.add(sub.attr)
    return {n for n in names if _is_private(n)}


def _is_self(node: ast.AST) -> bool:
    """``self``, ``cls``, ``super()``, ``type(self)``, ``self.__class__``: the object itself."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id == "super" or (node.func.id == "type" and len(node.args) == 1 and _is_self(node.args[0]))
    return isinstance(node, ast.Attribute) and node.attr == "__class__" and _is_self(node.value)


def _imported_module(node: ast.ImportFrom, rel: str) -> str:
    """The module an ``ImportFrom`` in file ``rel`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = Path(rel).with_suffix("").parts
    base = parts[:len(parts) - node.level]
    return ".".join(base + ((node.module,) if node.module else ()))


def shared_private_names(paths: list[Path]) -> set[str]:
    """Private names that more than one class in ``paths`` defines (see ``_own_names``)."""
    seen: dict[str, int] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for name in _own_names(node):
                    seen[name] = seen.get(name, 0) + 1
    return {name for name, n in seen.items() if n > 1}


def private_accesses(path: Path, root: Path, modules: set[str], shared: set[str]) -> list[tuple[str, int, str]]:
    """(file, line, code) of every access in ``path`` (under ``root``) that breaks the rule of
    ``test_no_private_attribute_access_across_owners``; ``modules``: dotted names of our modules,
    ``shared``: private names several classes define (``shared_private_names``)."""
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text(), rel)
    out: list[tuple[str, int, str]] = []

    def allowed(name: str, value: ast.AST, classes: list[set[str]]) -> bool:
        return _is_self(value) or (bool(classes) and name in classes[-1] and name not in shared) \
            or (rel, name) in THIRD_PARTY_PRIVATE

    def visit(node: ast.AST, classes: list[set[str]]) -> None:
        if isinstance(node, ast.ClassDef):
            classes = classes + [_own_names(node)]
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and not allowed(node.attr, node.value, classes):
            out.append((rel, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) and \
                _is_private(node.args[1].value) and not allowed(node.args[1].value, node.args[0], classes):
            out.append((rel, node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            src = _imported_module(node, rel)
            for a in node.names:
                if _is_private(a.name) and f"{src}.{a.name}" not in modules:
                    out.append((rel, node.lineno, f"from {src} import {a.name}"))
        for child in ast.iter_child_nodes(node):
            visit(child, classes)

    visit(tree, [])
    return out


def _module_names() -> set[str]:
    out = set()
    for path in _files():
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.add(".".join(parts))
    return out


def test_no_private_attribute_access_across_owners():
    """A name with one leading underscore (``_x``; dunders excepted) is private to the class or
    module that defines it. In ``paged/`` and ``kernels/``, ``obj._x`` (read, write or delete, and
    ``getattr``/``setattr``/``hasattr``/``delattr`` with a constant name) is allowed only when

    1. ``obj`` is the object itself: ``self``, ``cls``, ``super()``, ``type(self)``,
       ``self.__class__`` (inherited private attributes included: a subclass is the same object);
    2. it is in the body of class ``C`` (methods, nested functions, lambdas) and ``C`` itself
       defines ``_x`` (assigns ``self._x``, binds ``_x`` in its body or lists it in ``__slots__``)
       and no other class in ``paged/`` or ``kernels/`` does: a class may read its own kind's state,
       e.g. ``other._x`` in ``C.__eq__`` (the check goes by name, so a name two classes define is
       nobody's: ``engine._t0`` in a class that has a ``_t0`` of its own still fails);
    3. it is a third-party name listed in ``THIRD_PARTY_PRIVATE`` for that file, with the reason
       (a torch operator's own name, ``Tensor._version``, namedtuple's ``_replace``).

    Everything else fails: another class's private attribute (``pool._free_plain``), a module's
    private name from outside it (``mod._x``, ``from mod import _x`` of a name that is not a
    module), even within the same file (a module-level function or another class reaching into a
    class's state). A private *module* (``paged._kernels``) is a package's own business: importing
    it is allowed. What the owner shares, it offers as a public method or read-only property.
    """
    files = _files()
    modules, shared = _module_names(), shared_private_names(files)
    found = [a for path in files for a in private_accesses(path, ROOT, modules, shared)]
    assert not found, "private attributes used outside their owner:\n" + "\n".join(
        f"  {f}:{line}: {code}" for f, line, code in found)


def test_third_party_allowances_are_still_needed():
    """Every ``THIRD_PARTY_PRIVATE`` entry names a file that still uses that name (no stale licence)."""
    for (rel, name), why in THIRD_PARTY_PRIVATE.items():
        assert why and name in (ROOT / rel).read_text(), f"{rel} no longer uses {name}: drop the allowance"


def test_the_private_access_rule_catches_what_it_should(tmp_path):
    """The checker on a hand-made module: each forbidden form is reported, each allowed one is not."""
    src = tmp_path / "paged" / "probe.py"
    src.parent.mkdir()
    src.write_text(
        "from paged.core.block_pool import _hidden\n"       # 1: private name of another module
        "from . import _kernels\n"                           # a private module of the package: fine
        "class Pool:\n"
        "    __slots__ = ('_free',)\n"
        "    def __init__(self):\n"
        "        self._free = []\n"                          # own attribute: fine
        "    def same(self, other):\n"
        "        return other._free == self._free\n"         # same class: fine
        "    def peek(self, other):\n"
        "        return other._tables\n"                     # 8: not Pool's own name
        "class Manager(Pool):\n"
        "    def grab(self, pool):\n"
        "        pool._free.append(1)\n"                     # 13: Manager does not define _free
        "        super()._helper()\n"                        # the object itself: fine
        "def helper(kv):\n"
        "    kv._drop = 1\n"                                 # 16: write from a module function
        "    return getattr(kv, '_t0', 0)\n"                 # 17: getattr with a private name
        "t = (1, 2)._replace\n"                              # 18: namedtuple API, but not licensed here
    )
    modules = {"paged.core.block_pool", "paged._kernels"}
    lines = [line for _, line, _ in private_accesses(src, tmp_path, modules, shared_private_names([src]))]
    assert lines == [1, 10, 13, 16, 17, 18], lines
    other = tmp_path / "paged" / "other.py"  # a second class defining _free: Pool.same loses rule 2
    other.write_text("class Other:\n    def __init__(self):\n        self._free = 0\n")
    lines = [line for _, line, _ in private_accesses(src, tmp_path, modules, shared_private_names([src, other]))]
    assert lines == [1, 8, 10, 13, 16, 17, 18], lines


def test_no_file_over_400_lines():
    """One job per file: no module in ``paged/`` or ``kernels/`` is over ``MAX_LINES`` lines."""
    long = {p.relative_to(ROOT).as_posix(): n for p in _files()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by job): {long}"


def _calls_to(tree: ast.AST, method: str) -> list[int]:
    """Lines of every call ``<anything>.method(...)`` in ``tree``."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == method]


def test_only_the_step_loop_schedules():
    """One loop: nothing in the packages but ``paged/core/loop.py`` calls a scheduler's ``schedule()``
    (or moves requests on with ``update``): every executor, front, study and view goes through
    ``StepLoop``."""
    offenders = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "paged/core/loop.py":
            continue
        tree = ast.parse(path.read_text())
        offenders += [f"{rel}:{line}" for line in _calls_to(tree, "schedule")]
        # .update(plan, sampled): the scheduler's two-argument update (dict.update takes one)
        offenders += [f"{rel}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Call)
                      and isinstance(n.func, ast.Attribute) and n.func.attr == "update" and len(n.args) == 2]
    assert not offenders, f"only StepLoop may call schedule()/update(plan, sampled): {offenders}"
    loop = ast.parse((ROOT / "paged/core/loop.py").read_text())
    assert _calls_to(loop, "schedule"), "the step loop must be the one place that schedules"


def test_no_class_subclasses_the_kv_manager():
    """A KV cache implements the ``KVCache`` protocol; none subclasses ``KVCacheManager`` to stub it."""
    offenders = []
    for path in sorted(p for d in (*PACKAGES, "tests", "benchmarks", "tools") for p in (ROOT / d).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases}
                if "KVCacheManager" in bases:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not offenders, offenders


def test_the_kv_caches_implement_the_protocol():
    from paged.core.kv_cache import KVCache
    from paged.core.kv_manager import KVCacheManager
    from paged.sim.baselines import ContiguousKVCacheManager
    assert isinstance(KVCacheManager(8, 4), KVCache)
    assert isinstance(ContiguousKVCacheManager(64, "max", max_model_len=32), KVCache)
    from paged.core.hybrid_manager import HybridKVCacheManager
    from paged.core.kv_groups import make_layout
    assert isinstance(HybridKVCacheManager(16, make_layout(["full", "sliding"], 64, 4, window=8)), KVCache)


def test_no_delegation_through_getattr_in_core():
    """A class in ``paged/core`` states its interface: none forwards unknown names with ``__getattr__``
    (a wrapper writes each member of the protocol it implements)."""
    offenders = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in sorted((ROOT / "paged/core").rglob("*.py"))
                 for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.ClassDef)
                 for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "__getattr__"]
    assert not offenders, f"__getattr__ delegation in paged/core: {offenders}"
