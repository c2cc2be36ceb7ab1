"""Peak memory of a command and everything it starts (Ray's GCS, raylet, workers and actors included).

    python -m jobs.bench peak_memory -- .venv/bin/python -m jobs.extract --limit 16 ...

Samples the resident set size (RSS) of the command's whole process tree every --interval seconds and prints, when
it exits: the peak of the tree's summed RSS, and the peak RSS of each process (by command line, largest first).
`/usr/bin/time -v` only sees processes its child waits for, and Ray's workers are not among them.  Used to check
that a stage's memory does not grow with the number of prompts (run it at two sizes side by side).  Exits with the
command's exit code, after writing results.json."""
from __future__ import annotations

import argparse
import subprocess
import time

import psutil

NAME = "peak_memory"
HELP = "peak summed RSS of a command's whole process tree (Ray workers included), and per process"

MIB = 1 << 20


def add_arguments(ap) -> None:
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")


def name_of(p: psutil.Process) -> str:
    try:
        cmd = p.cmdline()
        name = p.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    # Ray names its workers "ray::<Actor>.<method>" in the process title
    if name.startswith("ray::") or (cmd and cmd[0].startswith("ray::")):
        return (cmd[0] if cmd else name).split(" ")[0][:60]
    return " ".join(cmd[:3])[-80:] if cmd else name


def run(a, harness) -> dict:
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        raise SystemExit("peak_memory: give the command after --")
    if a.interval <= 0:
        raise SystemExit(f"--interval must be > 0, got {a.interval}")
    t0 = time.time()
    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    peak_total, per = 0, {}
    while proc.poll() is None:
        total = 0
        try:
            tree = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:  # exited between poll() and here
            break
        for p in tree:
            try:
                rss = p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += rss
            old = per.get(p.pid)
            if old is None or rss > old[0]:
                per[p.pid] = (rss, name_of(p))
        peak_total = max(peak_total, total)
        time.sleep(a.interval)
    rc = proc.wait()
    print(f"\n[peak_memory] exit {rc} after {time.time() - t0:.0f}s; peak summed RSS of the process "
          f"tree {peak_total / MIB:,.0f} MiB")
    largest = sorted(per.items(), key=lambda kv: -kv[1][0])
    for pid, (v, name) in largest[:8]:
        print(f"[peak_memory]   {v / MIB:8,.0f} MiB  {name} [{pid}]")
    harness.table("peak RSS per process (largest 8)", ["process", "pid", "MiB"],
                  [[name, pid, f"{v / MIB:,.0f}"] for pid, (v, name) in largest[:8]])
    harness.exit_status = rc
    return {"cmd": cmd, "returncode": rc, "seconds": time.time() - t0, "peak_total_mib": peak_total / MIB,
            "per_process_mib": {f"{n} [{pid}]": v / MIB for pid, (v, n) in per.items()}}
