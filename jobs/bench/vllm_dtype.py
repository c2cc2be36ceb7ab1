"""vLLM CPU generation speed by compute precision, measured side by side in one run.

Each repetition runs every dtype in a fresh in-process vLLM engine (a subprocess each, interleaved A B, B A, ...),
batch of N synthetic 100-token prompts x T new tokens (ignore_eos), after a 2-request warm-up; prints tok/s per run,
the medians and the ratio.

    python -m jobs.bench vllm_dtype --batch 32 --tokens 64 --reps 2
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from actors.vllm_engine import build_llm
from pipeline.core.runtime import PROJECT_ROOT, apply_env
from pipeline.data.target_model import resolve_target

NAME = "vllm_dtype"
HELP = "vLLM CPU generation tok/s by compute precision (float32 vs bfloat16), a fresh engine process per run"


def add_arguments(ap) -> None:
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)


def generation_rate(dtype: str, batch: int, tokens: int) -> float:
    """Output tokens/s of one vLLM engine of ``dtype`` in this process (after a 2-request warm-up)."""
    apply_env()
    from vllm import SamplingParams

    llm = build_llm(str(resolve_target(None)), max_model_len=1024, dtype=dtype)
    prompts = [{"prompt_token_ids": [1, 2, 3, 400 + i, 500 + i] * 20} for i in range(batch)]
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    t = time.perf_counter()
    out = llm.generate(prompts, sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t)


def rate_in_fresh_process(dtype: str, batch: int, tokens: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()))
    p = subprocess.run([sys.executable, "-m", __name__, dtype, "--batch", str(batch), "--tokens", str(tokens)],
                       capture_output=True, text=True, env=env, cwd=PROJECT_ROOT)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
    if not line:
        raise SystemExit(f"{dtype}: no result (exit {p.returncode})\n{p.stderr[-2000:]}")
    return float(line[0].split()[1])


def run(a, harness) -> dict:
    dtypes = [d for d in a.dtypes.split(",") if d]
    if len(dtypes) < 2 or a.reps < 1 or a.batch < 2 or a.tokens < 1:
        raise SystemExit("--dtypes needs two or more dtypes, --reps/--tokens >= 1, --batch >= 2 (the warm-up "
                         f"takes 2); got {dtypes}, {a.reps}, {a.tokens}, {a.batch}")
    cases = {d: (lambda rep, d=d: rate_in_fresh_process(d, a.batch, a.tokens)) for d in dtypes}
    s = harness.interleave(cases, a.reps, label="tok/s",
                           on_call=lambda d, rep, v: print(f"rep {rep} {d:9s} {v['value']:8.1f} tok/s", flush=True))
    med = s.medians("value")
    print("median tok/s: " + ", ".join(f"{d} {m:.1f}" for d, m in med.items()))
    print(f"ratio {dtypes[0]}/{dtypes[1]}: {med[dtypes[0]] / med[dtypes[1]]:.2f}x")
    harness.compare(s, "value", baseline=dtypes[0], unit="tok/s", digits=1)
    return {"batch": a.batch, "tokens": a.tokens, "median_tok_s": med,
            "ratio": {f"{dtypes[0]}/{d}": med[dtypes[0]] / med[d] for d in dtypes[1:]}}


if __name__ == "__main__":  # one measurement, in the fresh process rate_in_fresh_process starts
    p = argparse.ArgumentParser(description="one vLLM generation-rate measurement (prints RESULT tok/s)")
    p.add_argument("dtype")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True)
    one = p.parse_args()
    print(f"RESULT {generation_rate(one.dtype, one.batch, one.tokens):.2f}")
