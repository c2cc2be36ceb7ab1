"""``python -m jobs.bench <name> [options]``: every benchmark of the project behind one CLI and one harness
(jobs/bench/harness.py describes the interface a benchmark module implements).

Discovery reads each module's NAME and HELP string literals from its source (``ast``), so listing the benchmarks
imports none of them (nor torch, vllm or ray); only the benchmark that runs is imported."""
from __future__ import annotations

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parent
NOT_BENCHMARKS = {"harness"}  # modules of this package that are not benchmarks (and every "_name")


@dataclass(frozen=True)
class BenchmarkInfo:
    name: str
    help: str
    path: Path
    problem: str | None = None  # why the module cannot be run (shown in the listing), None when it is valid


def _literal(tree: ast.Module, var: str) -> str | None:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == var and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            return node.value.value
    return None


def inspect_module(path: Path) -> BenchmarkInfo:
    """NAME / HELP of one benchmark module, from its source."""
    stem = path.stem
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as e:
        return BenchmarkInfo(stem, "", path, f"syntax error: {e}")
    name, help_ = _literal(tree, "NAME"), _literal(tree, "HELP")
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    missing = [f for f in ("add_arguments", "run") if f not in defined]
    if name is None or help_ is None:
        return BenchmarkInfo(stem, help_ or "", path, "needs NAME and HELP as string literals")
    if name != stem:
        return BenchmarkInfo(stem, help_, path, f"NAME {name!r} differs from the file name {stem!r}")
    if missing:
        return BenchmarkInfo(stem, help_, path, f"no {' / '.join(missing)} function")
    return BenchmarkInfo(name, help_, path)


def discover() -> dict[str, BenchmarkInfo]:
    """Every module of jobs/bench/ except the harness, ``__*__`` and ``_private`` ones, by name."""
    found = {}
    for path in sorted(BENCH_DIR.glob("*.py")):
        if path.stem.startswith("_") or path.stem in NOT_BENCHMARKS:
            continue
        info = inspect_module(path)
        found[info.name] = info
    return found


def load(name: str) -> ModuleType:
    """Import benchmark ``name`` (clear errors for an unknown or malformed one)."""
    known = discover()
    if name not in known:
        raise SystemExit(f"unknown benchmark {name!r}; known: {', '.join(known)}")
    if known[name].problem:
        raise SystemExit(f"benchmark {name} ({known[name].path}): {known[name].problem}")
    return importlib.import_module(f"{__name__}.{name}")
