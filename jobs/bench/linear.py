"""The CPU linear back ends of the fp32 target (pipeline/ops/packed_linear.py, pipeline/ops/small_m_linear.py), measured two
ways in one run.

1. Per weight SHAPE and row count: F.linear (MKL sgemm), oneDNN's packed layout and (where it builds) the small-M
   AVX2 kernel, interleaved (rotating order per repetition) on the same input, cycling through weight copies larger
   than the caches; medians; ratios packed / F.linear and kernel / packed (< 1: faster).  The crossover differs by
   shape (the LM head streams 50x more bytes than q/k/v).
2. The whole target forward for B new tokens at a 300-token context (TargetRunner.time_forwards) for each back end
   in --backends, the runners taking turns in rotating order each repetition; medians; ratio to the fastest.

    python -m jobs.bench linear [--target DIR] [--rows 1,2,4,8,16] [--reps 30]
        [--backends mkl,packed,hybrid,tuned,smallm] [--forward-reps 5] [--arena on|off|both]
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.ops import packed_linear, small_m_linear
from pipeline.ops.hugepages import huge_page_fraction
from pipeline.data.target_model import resolve_target
from pipeline.engine.target_runner import TargetRunner

NAME = "linear"
HELP = "CPU linear back ends of the fp32 target: F.linear vs oneDNN packed per weight shape, and whole forwards"


def add_arguments(ap) -> None:
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared SmolLM2-135M-Instruct)")
    ap.add_argument("--rows", default="1,2,4,8,16", help="input row counts (tokens in one forward)")
    ap.add_argument("--reps", type=int, default=30, help="interleaved repetitions (medians)")
    ap.add_argument("--cache-mb", type=int, default=256,
                    help="distinct weight copies per shape totalling at least this many MB (defeats the caches)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--backends", default="mkl,packed,hybrid,tuned,smallm",
                    help="back ends for the whole-forward comparison ('' = skip it; smallm is left out where the "
                         "kernel is unavailable)")
    ap.add_argument("--forward-reps", type=int, default=5, help="rotations of the whole-forward comparison")
    ap.add_argument("--arena", choices=["on", "off", "both"], default="off",
                    help="target runners with their plain weights in one huge-page block (pipeline/ops/hugepages.py), "
                         "without (default, as TargetRunner's), or both side by side")
    ap.add_argument("--skip-shapes", action="store_true", help="only the whole-forward comparison")


def target_shapes(target: Path) -> dict[str, tuple[int, int]]:
    """name -> (out, in) of every linear weight shape of a Llama-style target as TargetRunner holds it (q/k/v and
    gate/up fused)."""
    c = json.loads((target / "config.json").read_text())
    d, f, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return {"qkv": (q + 2 * kv, d), "o": (d, q), "gate_up": (2 * f, d), "down": (d, f), "lm_head": (V, d)}


def time_calls(fn, x, weights: list) -> float:
    """Mean seconds of fn(x, w) over the distinct copies ``weights`` (together larger than the caches, so every
    call streams its weight from memory, as in a real forward through 30 layers)."""
    t0 = time.perf_counter()
    for w in weights:
        fn(x, w)
    return (time.perf_counter() - t0) / len(weights)


def run(a, harness) -> dict:
    if a.threads:
        torch.set_num_threads(a.threads)
    if not packed_linear.available():
        raise SystemExit("this PyTorch build has no oneDNN packed linear")
    rows = [int(r) for r in a.rows.split(",")]
    if a.reps < 1 or a.forward_reps < 1 or min(rows) < 1:
        raise SystemExit(f"--reps, --forward-reps and --rows must be >= 1, got {a.reps}, {a.forward_reps}, {rows}")
    target = Path(resolve_target(a.target))
    out = {"target": str(target), "threads": torch.get_num_threads(), "rows": rows}
    if not a.skip_shapes:
        out["per_shape_ms"] = per_shape(harness, target, rows, a.reps, a.cache_mb)
    backends = [b for b in a.backends.split(",") if b]
    if "smallm" in backends and not small_m_linear.available():
        print(f"smallm left out: {small_m_linear.unavailable_reason()}")
        backends.remove("smallm")
    if backends:
        out["whole_forward_ms"] = whole_forward(harness, target, rows, backends, a.forward_reps, a.arena)
    return out


def per_shape(harness, target: Path, rows: list[int], reps: int, cache_mb: int) -> dict:
    """{shape: {rows: {"F.linear": ms, "packed": ms, "ratio": packed / F.linear[, "kernel": ms, "kernel_ratio":
    kernel / packed]}}} (medians; the kernel where pipeline/ops/small_m_linear.py is available)."""
    shapes = target_shapes(target)
    kernel = small_m_linear.available()
    g = torch.Generator().manual_seed(0)
    print(f"per shape: threads {torch.get_num_threads()}, {reps} interleaved reps; ms per call "
          + ("(F.linear / packed / kernel, packed÷F.linear, kernel÷packed)" if kernel
             else "(F.linear / packed, packed÷F.linear)"))
    width = 34 if kernel else 22
    print(f"{'shape':>22} " + " ".join(f"{r:>{width}}" for r in rows))
    result = {}
    with torch.inference_mode():
        for name, (o, i) in shapes.items():
            copies = max(2, -(-cache_mb * 2**20 // (4 * o * i)))
            ws = [torch.randn(o, i, generator=g) * 0.02 for _ in range(copies)]
            pws = [packed_linear.pack(w) for w in ws]
            cells, result[name] = [], {}
            for r in rows:
                x = torch.randn(r, i, generator=g)
                cases = {"F.linear": lambda rep: time_calls(F.linear, x, ws),
                         "packed": lambda rep: time_calls(lambda x_, w: packed_linear.packed_linear(x_, w, None),
                                                          x, pws)}
                if kernel and small_m_linear.usable(ws[0]):
                    cases["kernel"] = lambda rep: time_calls(small_m_linear.linear, x, ws)
                s = harness.interleave(cases, reps, warmup=1, order="rotate", label=f"shape {name} rows {r}")
                m, p = s.median("F.linear", "value") * 1e3, s.median("packed", "value") * 1e3
                result[name][r] = {"F.linear": m, "packed": p, "ratio": p / m}
                cell = f"{m:6.2f}/{p:6.2f}"
                if "kernel" in cases:
                    k = s.median("kernel", "value") * 1e3
                    result[name][r].update(kernel=k, kernel_ratio=k / p)
                    cell += f"/{k:6.2f} {p / m:4.2f}x {k / p:4.2f}x"
                else:
                    cell += f" {p / m:4.2f}x"
                cells.append(cell)
            print(f"{name + ' ' + str((o, i)):>22} " + " ".join(f"{c:>{width}}" for c in cells), flush=True)
    return result


def whole_forward(harness, target: Path, rows: list[int], backends: list[str], reps: int, arena: str) -> dict:
    """{back end: {rows: median ms}} of whole target forwards."""
    runners = {}
    for on in {"on": [True], "off": [False], "both": [True, False]}[arena]:
        tag = "" if arena != "both" else ("+arena" if on else "-arena")
        built = TargetRunner.several_from_pretrained(target, [f"float32:{b}" for b in backends], huge_page_arena=on)
        runners.update({spec + tag: r for spec, r in built.items()})
    specs = list(runners)
    for spec, r in runners.items():
        frac = huge_page_fraction([w.weight for w in r.linear_weights() if w.weight is not None])
        print(f"{spec}: plain weights on huge pages {frac if frac is None else f'{frac:.0%}'}")
    for spec, r in runners.items():
        if r.flinear_rows:
            print(f"{spec}: F.linear up to rows {r.flinear_rows}")
    cases = {spec: (lambda rep, r=runners[spec]: {str(b): t for b, t in
                                                  r.time_forwards(rows, repeats=3, warmup=1).items()})
             for spec in specs}
    s = harness.interleave(cases, reps, order="rotate", label="whole forward")
    med = {sp: {b: s.median(sp, str(b)) * 1e3 for b in rows} for sp in specs}
    print(f"whole forward, 300-token context, {reps} rotations x 3 sweeps: ms (ratio to the fastest back end)")
    print(f"{'back end':>22} " + " ".join(f"{b:>14}" for b in rows))
    for sp in specs:
        cells = [f"{med[sp][b]:6.1f} ({med[sp][b] / min(med[x][b] for x in specs):4.2f})" for b in rows]
        print(f"{sp:>22} " + " ".join(f"{c:>14}" for c in cells), flush=True)
    return med
