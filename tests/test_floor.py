"""The floor under specdec: imports flow one way, shared names are defined once, every error
is a `SpecdecError` defined in an errors module.

Read from the source (ast), so a function-level import counts like a module-level one, and
one under `if TYPE_CHECKING:` too: an annotation that names a module above is an arrow up.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import pkgutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "specdec"

# specdec's layers, lowest first: a module imports its own layer or lower ones, never higher.
# A new module takes its place here (the test fails on a module no layer names).
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"types", "errors", "request", "config"}),  # the floor: names every layer shares
    frozenset({"blas", "convert", "ragged", "reasoning", "lookup", "decode", "sampling",
               "chat", "grammar", "tools", "models", "distill_data", "budget",
               "prompt_bound", "schema_rewrite", "unique"}),  # leaves
    frozenset({"request_grammar", "prepare"}),  # a request's grammar, and the prepared request
    frozenset({"speculative", "events", "output", "core"}),  # the decode core
    frozenset({"scheduler", "distributed"}),  # rounds over requests, and replicas of them
    frozenset({"engine"}),  # the door: models, preparation and the scheduler
    frozenset({"cli", "catalog", "distill", "__main__", "__init__"}),  # entry points
)

# The server's layers, lowest first (it imports specdec freely: specdec never imports it).
SERVER_LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"errors", "metrics", "openapi", "store"}),  # its floor
    frozenset({"fleet"}),  # the engines it serves, by model name
    frozenset({"door"}),  # what every API does with a request
    frozenset({"chat_wire", "responses_wire", "messages_wire"}),  # each API's wire types
    frozenset({"background"}),  # runs that go on without their client (background responses)
    frozenset({"chat", "responses", "messages", "conversations"}),  # each API's routes
    frozenset({"app", "__init__"}),  # the application
)
PACKAGES = {"specdec": LAYERS, "server": SERVER_LAYERS}


def _layer(module: str, layers: tuple[frozenset[str], ...] = LAYERS) -> int:
    for i, layer in enumerate(layers):
        if module in layer:
            return i
    raise AssertionError(f"{module}.py is in no layer of tests/test_floor.py: place it")


def _imports(path: pathlib.Path, modules: set[str], package: str = "specdec"
             ) -> dict[str, int]:
    """`package`'s modules `path` imports (name -> line): module- and function-level, and
    under `if TYPE_CHECKING:` (an annotation's arrow is an arrow)."""
    tree = ast.parse(path.read_text())
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 or node.module == package or (
                    node.module or "").startswith(package + "."):
                mod = node.module or ""
                mod = mod.removeprefix(package).lstrip(".") if node.level == 0 else mod
                names = [mod.split(".")[0]] if mod else [a.name for a in node.names]
            elif node.level > 1:
                raise AssertionError(f"{path.name}:{node.lineno}: imports from above the package")
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names
                     if a.name.startswith(package + ".")]
        for n in names:
            if n in modules and n != path.stem:
                out.setdefault(n, node.lineno)
    return out


def _graph(package: str = "specdec") -> dict[str, dict[str, int]]:
    paths = sorted((ROOT / package).glob("*.py"))
    modules = {p.stem for p in paths}
    return {p.stem: _imports(p, modules, package) for p in paths}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                found.append(path[path.index(v):] + [v])
            elif v not in state:
                visit(v, path)
        path.pop()
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u, [])
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_have_no_cycle(package):
    cycles = _cycles(_graph(package))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_never_reach_up_a_layer(package):
    graph, layers = _graph(package), PACKAGES[package]
    up = [f"{package}/{m}.py:{line} imports {n} (layer {_layer(n, layers)} over "
          f"{_layer(m, layers)})" for m, deps in graph.items() for n, line in deps.items()
          if _layer(n, layers) > _layer(m, layers)]
    assert not up, "upward imports:\n" + "\n".join(up)


def test_the_floor_imports_nothing_above_it():
    graph = _graph()
    for m in LAYERS[0]:
        assert set(graph[m]) <= LAYERS[0], f"{m} imports {sorted(set(graph[m]) - LAYERS[0])}"


def test_the_walker_sees_function_level_and_typing_only_imports(tmp_path):
    # a mutation check on the walker itself: an import inside a function counts, and so does
    # one under TYPE_CHECKING
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .engine import Engine\n"
           "def f():\n    from .scheduler import Scheduler\n    import specdec.core\n")
    p = tmp_path / "probe.py"
    p.write_text(src)
    assert set(_imports(p, {"engine", "scheduler", "core", "output"})) == {
        "engine", "scheduler", "core"}
    assert _cycles({"a": {"b": 1}, "b": {"a": 1}}) == [["a", "b", "a"]]


def _own_modules() -> list[str]:
    names = []
    for pkg in ("specdec", "server"):
        mod = importlib.import_module(pkg)
        names += [f"{pkg}.{m.name}" for m in pkgutil.iter_modules(mod.__path__)
                  if m.name != "__main__"]
    return names


def test_every_error_class_is_a_specdec_error_defined_in_an_errors_module():
    from specdec.errors import SpecdecError

    seen = {}
    for name in _own_modules():
        mod = importlib.import_module(name)
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__.split(".")[0] in (
                    "specdec", "server"):
                seen[cls.__qualname__] = cls
    assert len(seen) >= 20, sorted(seen)  # the walk found the package's errors
    outside = [n for n, c in seen.items() if not issubclass(c, SpecdecError)]
    assert not outside, f"not SpecdecError: {outside}"
    astray = [f"{n} in {c.__module__}" for n, c in seen.items()
              if c.__module__ not in ("specdec.errors", "server.errors")]
    assert not astray, f"error classes outside an errors module: {astray}"
    from typing import get_args

    from server.errors import STATUS
    from specdec.errors import ErrorKind

    assert {c.kind for c in seen.values()} <= set(get_args(ErrorKind)) == set(STATUS)


@pytest.mark.parametrize("name", ["TokenId", "FinishReason"])
def test_shared_names_are_defined_once_on_the_floor(name):
    where = []
    for p in sorted([*PACKAGE.glob("*.py"), *(ROOT / "server").glob("*.py")]):
        for node in ast.walk(ast.parse(p.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AnnAssign)
                       else [])
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                where.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert where == ["specdec/types.py:" + where[0].split(":")[1]], where


def _private_crossings(path: pathlib.Path, strict: bool) -> list[str]:
    """Private names (`_x`) `path` takes from another module: imported by name, read off an
    imported module of ours, or (`strict`: the server and a sharded target's follower, which
    use the Engine through its public surface only) read off any object but `self`/`cls`."""
    tree = ast.parse(path.read_text())
    ours: set[str] = set()  # local names bound to modules of ours
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (
                node.module or "").split(".")[0] in ("specdec", "server")):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{path.name}:{node.lineno} imports {a.name}")
                ours.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            ours.update(a.asname or a.name.split(".")[0] for a in node.names
                        if a.name.split(".")[0] in ("specdec", "server"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                not node.attr.startswith("__") and isinstance(node.value, ast.Name):
            owner = node.value.id
            if owner in ("self", "cls") or (strict and owner == "os"):
                continue
            if owner in ours or strict:
                found.append(f"{path.name}:{node.lineno} reads {owner}.{node.attr}")
    return found


def test_no_private_name_crosses_a_module_line():
    files = [*PACKAGE.glob("*.py"), *(ROOT / "server").glob("*.py")]
    found = [f for p in sorted(files) for f in _private_crossings(
        p, strict=p.parent.name == "server" or p.name == "distributed.py")]
    assert not found, "\n".join(found)


def test_the_private_name_check_sees_imports_module_reads_and_engine_internals(tmp_path):
    p = tmp_path / "probe.py"
    p.write_text("from .grammar import _schema\nfrom . import ragged\n"
                 "def f(engine):\n    ragged._depths\n    engine._active\n    self._ok\n")
    assert _private_crossings(p, strict=False) == [
        "probe.py:1 imports _schema", "probe.py:4 reads ragged._depths"]
    assert "probe.py:5 reads engine._active" in _private_crossings(p, strict=True)


def _functions(paths):
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield p, node


def test_every_matcher_parameter_is_typed():
    # a grammar's state is an `LLMatcher` or the `types.GrammarState` protocol: never `Any`,
    # never unannotated
    found = []
    for p, fn in _functions(sorted([*PACKAGE.glob("*.py"), *(ROOT / "server").glob("*.py")])):
        args = fn.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if "matcher" in a.arg and (a.annotation is None or
                                       "Any" in ast.unparse(a.annotation)):
                found.append(f"{p.name}:{fn.lineno} {fn.name}({a.arg})")
    assert not found, "untyped matcher parameters:\n" + "\n".join(found)


@pytest.mark.parametrize("module", ["reasoning", "speculative", "events"])
def test_no_attribute_is_invisible(module):
    # no `__getattr__`: what an object has, its class says
    found = [f"{module}.py:{fn.lineno}" for _, fn in _functions([PACKAGE / f"{module}.py"])
             if fn.name == "__getattr__"]
    assert not found, found


def test_a_decode_state_has_at_most_twenty_fields():
    import dataclasses

    from specdec.core import DecodeState

    fields = [f.name for f in dataclasses.fields(DecodeState)]
    assert len(fields) <= 20, fields


def test_no_thread_pool_is_made_at_import():
    # a pool (or thread) is made by its owner when it is needed, not when a module is imported
    found = []
    for p in sorted([*PACKAGE.glob("*.py"), *(ROOT / "server").glob("*.py")]):
        for node in ast.parse(p.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.Expr)) and any(
                    isinstance(c, ast.Call) and any(w in ast.unparse(c.func) for w in (
                        "ThreadPoolExecutor", "ProcessPoolExecutor", "Thread"))
                    for c in ast.walk(node)):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
