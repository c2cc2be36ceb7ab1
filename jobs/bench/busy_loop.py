"""Two pure-Python loops, one of --iterations and one of twice as many, timed interleaved by the harness.

The work ratio is exactly 2, so the measured ratio of the medians shows how far this CPU's timing noise moves a
comparison (and checks the harness: alternating order, medians, results.json).

    python -m jobs.bench busy_loop --iterations 200000 --reps 9
"""
from __future__ import annotations

NAME = "busy_loop"
HELP = "two pure-Python loops of N and 2N iterations, interleaved: the timing noise floor (ratio should be 2)"


def add_arguments(parser) -> None:
    parser.add_argument("--iterations", type=int, default=200_000, help="iterations of the shorter loop")
    parser.add_argument("--reps", type=int, default=9, help="interleaved repetitions (medians)")
    parser.add_argument("--warmup", type=int, default=1, help="repetitions left out of the medians")


def spin(n: int) -> int:
    acc = 0
    for i in range(n):
        acc += i & 7
    return acc


def run(args, harness) -> dict:
    if args.iterations < 1 or args.reps < 1:
        raise SystemExit(f"--iterations and --reps must be >= 1, got {args.iterations}, {args.reps}")
    cases = {"1x": lambda rep: {"iterations": args.iterations, "checksum": spin(args.iterations)},
             "2x": lambda rep: {"iterations": 2 * args.iterations, "checksum": spin(2 * args.iterations)}}
    s = harness.interleave(cases, args.reps, warmup=args.warmup, label="loops")
    table = harness.compare(s, baseline="1x", scale=1e3, unit="ms")
    return {"iterations": args.iterations, "median_ms": {c: r["median"] for c, r in table.items()},
            "ratio_2x_to_1x": table["2x"]["ratio"]}
