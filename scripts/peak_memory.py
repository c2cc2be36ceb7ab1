"""Peak memory of a command and everything it starts (Ray's GCS, raylet, workers and actors included).

    .venv/bin/python scripts/peak_memory.py -- .venv/bin/python -m jobs.extract --limit 16 ...

Samples the resident set size (RSS) of the command's whole process tree every --interval seconds and prints, when
it exits: the peak of the tree's summed RSS, and the peak RSS of each process (by command line, largest first).
`/usr/bin/time -v` only sees processes its child waits for, and Ray's workers are not among them.  Used to check
that a stage's memory does not grow with the number of prompts (run it at two sizes side by side)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.5)
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        ap.error("give the command after --")
    t0 = time.time()
    proc = subprocess.Popen(cmd)
    root = psutil.Process(proc.pid)
    peak_total, per = 0, {}
    while proc.poll() is None:
        total = 0
        for p in [root] + root.children(recursive=True):
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
    mib = 1 << 20
    print(f"\n[peak_memory] exit {proc.returncode} after {time.time() - t0:.0f}s; peak summed RSS of the process "
          f"tree {peak_total / mib:,.0f} MiB")
    for pid, (v, name) in sorted(per.items(), key=lambda kv: -kv[1][0])[:8]:
        print(f"[peak_memory]   {v / mib:8,.0f} MiB  {name} [{pid}]")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cmd": cmd, "returncode": proc.returncode, "peak_total_mib": peak_total / mib,
                       "per_process_mib": {f"{n} [{pid}]": v / mib for pid, (v, n) in per.items()}}, f, indent=1)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
