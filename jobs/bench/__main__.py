"""``python -m jobs.bench --help`` lists the benchmarks; ``python -m jobs.bench <name> --help`` shows one's
options; ``python -m jobs.bench <name> [--out DIR] [options]`` runs it, prints its tables and writes
DIR/results.json (default DIR: <work>/bench/<name>)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jobs.bench import discover, load
from jobs.bench.harness import Harness
from pipeline.core.runtime import reexec_for_process_env, work_dir

PROG = "python -m jobs.bench"


def listing() -> str:
    infos = discover()
    width = max((len(n) for n in infos), default=0)
    lines = [f"usage: {PROG} <benchmark> [--out DIR] [options]   ({PROG} <benchmark> --help: its options)", "",
             "benchmarks:"]
    for name, info in infos.items():
        text = info.help if not info.problem else f"(broken: {info.problem}) {info.help}"
        lines.append(f"  {name.ljust(width)}  {text}")
    lines += ["", "Each run prints an environment header and its tables and writes <out>/results.json "
              "(default <work>/bench/<benchmark>)."]
    return "\n".join(lines)


def build_parser(name: str, module) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{PROG} {name}", description=module.__doc__ or module.HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help=f"folder for results.json and any other output (default: <work>/bench/{name})")
    module.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return 0
    name = argv[0]
    module = load(name)
    args = build_parser(name, module).parse_args(argv[1:])
    harness = Harness(name, args.out or work_dir() / "bench" / name, [name] + argv[1:])
    print(harness.header(), flush=True)
    results = module.run(args, harness)
    path = harness.write(results)
    print(f"\n[bench] results: {path}", flush=True)
    return harness.exit_status


if __name__ == "__main__":
    reexec_for_process_env()  # loopback/offline environment, and start-only malloc tunables for this process
    sys.exit(main())
