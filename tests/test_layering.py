"""The import structure: one-way layers, no cycles, project imports at module level.

    jobs  ->  serve_app, actors  ->  pipeline

pipeline never imports actors / serve_app / jobs; actors and serve_app never import jobs; serve_app and actors do
not import each other.  Inside pipeline the subpackages have floors of their own (``PIPELINE_ALLOWED``, each
subpackage's ``__init__`` docstring says the same): core at the bottom, then ops, data, dspark, stores; the engine
(no training or evaluation code), train, eval; launch on top.  Project modules import each other at module level only (an in-function import of a project
module hides a cycle or an upward import); in-function imports are for heavy optional dependencies (ray, vllm,
mooncake, matplotlib, transformers, ...), which this test does not restrict -- nor the lazy import of a project
module that itself loads ray, vllm or mooncake at import time (``serve_app.replica`` brings Ray Serve, so the
config / --dry-run path of ``serve_app.app`` imports it only when an application is built).  The entry points in
``jobs`` import the project where they run, so that their start stays light: ``python -m jobs.X`` re-execs itself
with its start-only settings before torch is loaded (pipeline.core.runtime.reexec_for_process_env), and
``python -m jobs.bench --help`` lists every benchmark without importing what they measure.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeline", "actors", "serve_app", "jobs")
# which top-level packages each package may import
ALLOWED = {
    "pipeline": {"pipeline"},
    "actors": {"actors", "pipeline"},
    "serve_app": {"serve_app", "pipeline"},
    "jobs": {"jobs", "serve_app", "actors", "pipeline"},
}


# which pipeline subpackages each pipeline subpackage may import (itself included)
PIPELINE_ALLOWED = {
    "core": {"core"},
    "ops": {"core", "ops"},
    "data": {"core", "data"},
    "dspark": {"core", "ops", "data", "dspark"},
    "stores": {"core", "data", "stores"},
    "engine": {"core", "ops", "data", "dspark", "engine"},
    "train": {"core", "ops", "data", "dspark", "stores", "train"},
    "eval": {"core", "ops", "data", "dspark", "stores", "engine", "eval"},
    "launch": {"core", "ops", "data", "dspark", "stores", "engine", "train", "eval", "launch"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            mods[_module_name(p)] = p
    return mods


def _resolve(node: ast.AST, current: str, is_pkg: bool, mods: dict[str, Path]) -> list[str]:
    """The project modules an import statement names (``from a.b import c`` -> a.b.c if that is a module, else a.b)."""
    out = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = current.split(".") if is_pkg else current.split(".")[:-1]
            pkg = pkg[:len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    for n in names:
        while n and n not in mods:  # `import pipeline.dspark.drafter` names the module; a.b.attr -> a.b
            n = n.rpartition(".")[0]
        if n and n.split(".")[0] in PACKAGES:
            out.append(n)
    return out


HEAVY = ("ray", "vllm", "mooncake")


def heavy_modules() -> set[str]:
    """Project modules that load ray / vllm / mooncake when imported (directly or through project modules)."""
    mods = project_modules()
    top, _ = import_edges()
    heavy = set()
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:  # module level only (not functions, not `if TYPE_CHECKING` blocks)
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] in HEAVY for n in names):
                heavy.add(name)
    grew = True
    while grew:
        grew = False
        for name, deps in top.items():
            if name not in heavy and deps & heavy:
                heavy.add(name)
                grew = True
    return heavy


def import_edges():
    """-> (module-level edges {mod: {imported}}, in-function imports [(mod, line, imported, outermost function)])."""
    mods = project_modules()
    top, nested = {}, []
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        top[name] = set()
        func_of = {}  # id(import node) -> name of the outermost function around it
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(fn):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        func_of.setdefault(id(inner), fn.name)  # ast.walk meets outer functions first
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for dep in _resolve(node, name, is_pkg, mods):
                if dep == name:
                    continue
                if id(node) in func_of:
                    nested.append((name, node.lineno, dep, func_of[id(node)]))
                else:
                    top[name].add(dep)
    return top, nested


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path a -> ... -> a) or None; iterative DFS with colours."""
    colour = {m: 0 for m in edges}  # 0 new, 1 on the stack, 2 done
    for start in sorted(edges):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(edges[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(nxt, 2) == 1:
                return path[path.index(nxt):] + [nxt]
            elif colour.get(nxt, 2) == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(edges[nxt]))))
                path.append(nxt)
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    top, nested = import_edges()
    for mod, _, dep, _ in nested:  # count in-function imports too: deferring an import does not remove a cycle
        top[mod].add(dep)
    cycle = find_cycle(top)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_flow_one_way():
    top, nested = import_edges()
    bad = []
    for mod, deps in top.items():
        bad += [f"{mod} imports {d}" for d in deps if d.split(".")[0] not in ALLOWED[mod.split(".")[0]]]
    bad += [f"{mod}:{line} imports {d}" for mod, line, d, _ in nested
            if d.split(".")[0] not in ALLOWED[mod.split(".")[0]]]
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_pipeline_subpackages_keep_their_floors():
    """e.g. the engine imports no training code and dspark no engine code; pipeline/ holds subpackages only."""
    loose = [p.name for p in (ROOT / "pipeline").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"modules directly in pipeline/ (put them in the subpackage of their concern): {loose}"
    assert set(PIPELINE_ALLOWED) == {p.name for p in (ROOT / "pipeline").iterdir()
                                     if (p / "__init__.py").is_file()}, "a subpackage without a rule"
    top, nested = import_edges()
    edges = [(m, d) for m, ds in top.items() for d in ds] + [(m, d) for m, _, d, _ in nested]
    bad = sorted({f"{m} imports {d}" for m, d in edges if m.startswith("pipeline.") and d.startswith("pipeline.")
                  and d.split(".")[1] not in PIPELINE_ALLOWED[m.split(".")[1]]})
    assert not bad, "imports across pipeline's floors:\n" + "\n".join(bad)


def test_heavy_modules_are_found():
    heavy = heavy_modules()
    assert {"serve_app.replica", "actors.cpu_hidden_states_connector"} <= heavy  # ray.serve / vllm at import
    assert "pipeline.dspark.drafter" not in heavy and "pipeline.engine.engine" not in heavy


def test_project_imports_are_at_module_level():
    _, nested = import_edges()
    heavy = heavy_modules()
    nested = [n for n in nested if not n[0].startswith("jobs.") and n[2] not in heavy]
    listing = "\n".join(f"{mod}:{line} imports {dep} (in {fn})" for mod, line, dep, fn in sorted(set(nested)))
    assert not nested, "in-function imports of project modules (move them to the top of the module):\n" + listing
