"""The import graph reads in one direction: no cycles, no upward imports, no test machinery
in the product. Every import counts, including those inside functions and imports by name:
``importlib.import_module``/``__import__`` of a string, and a module's name in a module-level
table (a dispatch table loads what it names)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"thc": ROOT / "host", "thc.controller": ROOT / "controller",
            "thc.emu": ROOT / "mininet" / "thcnet"}

LAYERS = [
    ("thc.codec", "thc.namespace", "thc.built", "thc.argtypes", "thc.lifetime"),
    ("thc.wire",),
    ("thc.net",),
    ("thc.collective",),
    ("thc.app", "thc.bench", "thc.testing"),
    ("thc.controller",),
    ("thc.emu",),
    ("thc.cli",),
]
"""Bottom first: a module may import its own layer and those below, never above. The ``thc``
command's dispatcher is on top, so every subcommand it names points down."""

TESTING = ("thc.testing", "thc.controller.testing")
TESTING_USERS = ("thc.testing", "thc.controller.testing", "thc.bench", "thc.controller.bench",
                 "thc.controller.bench_install", "thc.emu")
"""Test machinery is used by tests, benchmarks and the emulation only."""


def modules() -> dict[str, Path]:
    """Python modules and C extensions (``_name.c`` builds module ``_name``: a leaf)."""
    out = {}
    for pkg, root in PACKAGES.items():
        for path in [*root.rglob("*.py"), *root.rglob("_*.c")]:
            rel = path.relative_to(root).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


IMPORT_CALLS = ("import_module", "__import__")


def imports_by_name(tree: ast.Module, known: set[str]) -> set[str]:
    """Modules named by a string given to an import call anywhere, or held in a module-level
    assignment (a dispatch table names them by dotted path: a bare ``"thc"`` there is the
    P4 program's name more often than the package)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if (called in IMPORT_CALLS and isinstance(first, ast.Constant)
                    and isinstance(first.value, str)):
                found.add(first.value)
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            found |= {n.value for n in ast.walk(stmt.value) if isinstance(n, ast.Constant)
                      and n.value in known and "." in n.value}
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules that ``name`` imports anywhere in its source, by statement or by
    name."""
    found = set()
    if path.suffix == ".c":
        return found
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    for t in imports_by_name(tree, known):
        while t and t not in known:
            t = t.rpartition(".")[0]
        if t and t != name:
            found.add(t)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def layer(module: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    if module == "thc":
        return len(LAYERS) - 1
    raise AssertionError(f"module {module} is in no layer: add it to LAYERS")


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
                  for a, deps in g.items() for b in deps if layer(b) > layer(a))


def find_testing_leaks(g: dict[str, set[str]]) -> list[str]:
    def under(m, prefixes):
        return any(m == p or m.startswith(p + ".") for p in prefixes)
    return sorted(f"{a} imports test machinery {b}" for a, deps in g.items() for b in deps
                  if under(b, TESTING) and not under(a, TESTING_USERS))


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
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

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    for name in graph():
        layer(name)


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_no_upward_imports():
    assert upward_imports(graph()) == []


def test_test_machinery_stays_out_of_the_product():
    assert find_testing_leaks(graph()) == []


@pytest.mark.parametrize("bad, check", [
    ({"thc.codec.thc": {"thc.net.client"}, "thc.net.client": set()}, upward_imports),
    ({"thc.codec.a": {"thc.codec.b"}, "thc.codec.b": {"thc.codec.a"}}, cycles),
    ({"thc.net.client": {"thc.testing.clusters"}, "thc.testing.clusters": set()},
     find_testing_leaks),
])
def test_the_checks_catch_violations(bad, check):
    assert check(bad)


def test_extensions_are_leaf_modules():
    """``from thc.codec import _fastcodec`` names the extension, not the package (whose
    __init__ imports thc.py, which imports the extension's wrapper)."""
    g = graph()
    assert "thc.codec._fastcodec" in g and g["thc.codec._fastcodec"] == set()
    assert "thc.codec._fastcodec" in g["thc.codec.fastcodec"]
    assert "thc.codec" not in g["thc.codec.fastcodec"]


def test_function_local_imports_count(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from thc.controller.switch import Switch\n")
    assert imports_of("thc.codec.m", mod, {"thc.controller.switch", "thc.codec.m"}) == \
        {"thc.controller.switch"}



@pytest.mark.parametrize("source", [
    "import importlib\ndef f():\n    return importlib.import_module('thc.controller.switch')\n",
    "from importlib import import_module\nm = import_module('thc.controller.switch')\n",
    "def f():\n    return __import__('thc.controller.switch')\n",
    "COMMANDS = {'install': ('thc.controller.switch', 'program the switch')}\n",
])
def test_imports_by_name_count(tmp_path, source):
    mod = tmp_path / "m.py"
    mod.write_text(source)
    known = {"thc.controller.switch", "thc.codec.m"}
    assert imports_of("thc.codec.m", mod, known) == {"thc.controller.switch"}


def test_strings_that_name_no_module_or_sit_in_functions_are_not_imports(tmp_path):
    """A subprocess's ``-m`` argument in a function runs another process, not an import;
    prose that mentions a module is no import either, nor a bare name that a package shares
    (the P4 program ``"thc"``)."""
    mod = tmp_path / "m.py"
    mod.write_text("HELP = 'see thc.controller.switch for the details'\n"
                   "PROGRAM = 'thc'\n"
                   "def f():\n    return ['python', '-m', 'thc.controller.switch']\n")
    known = {"thc", "thc.controller.switch", "thc.codec.m"}
    assert imports_of("thc.codec.m", mod, known) == set()


FOLDER_NAMES = ("host", "controller", "thcnet")
"""The folders' own names: the packages are thc, thc.controller and thc.emu."""


def folder_name_imports(paths) -> list[str]:
    """Imports, anywhere in ``paths``, of a folder's name instead of its package's."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            out += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[0] in FOLDER_NAMES]
    return out


def test_nothing_imports_a_folder_name():
    code = [*modules().values(), *(ROOT / "tests").rglob("*.py")]
    assert folder_name_imports(p for p in code if p.suffix == ".py") == []


def test_the_dispatcher_is_on_top_and_names_every_layer():
    g = graph()
    assert layer("thc.cli") == len(LAYERS) - 1
    assert {"thc.net.aggregator", "thc.controller.cli", "thc.emu.mainjob",
            "thc.controller.bench"} <= g["thc.cli"]
