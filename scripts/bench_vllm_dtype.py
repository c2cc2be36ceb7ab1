"""vLLM CPU generation speed by compute precision, measured side by side in one run.

Each repetition runs every dtype in a fresh in-process vLLM engine (a subprocess each, interleaved A B A B ...),
batch of N synthetic 100-token prompts x T new tokens (ignore_eos), after a 2-request warm-up; prints tok/s per run,
the medians and the ratio.  Usage: .venv/bin/python scripts/bench_vllm_dtype.py --batch 32 --tokens 64 --reps 2
"""
import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(dtype: str, batch: int, tokens: int) -> float:
    sys.path.insert(0, str(ROOT))
    from pipeline.runtime import apply_env

    apply_env()
    from actors.vllm_engine import build_llm
    from pipeline.target_model import resolve_target
    from vllm import SamplingParams

    llm = build_llm(str(resolve_target(None)), max_model_len=1024, dtype=dtype)
    prompts = [{"prompt_token_ids": [1, 2, 3, 400 + i, 500 + i] * 20} for i in range(batch)]
    sp = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    t = time.perf_counter()
    out = llm.generate(prompts, sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--_one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._one:
        print(f"RESULT {one(a._one, a.batch, a.tokens):.2f}")
        return
    dtypes = a.dtypes.split(",")
    res = {d: [] for d in dtypes}
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()))
    for rep in range(a.reps):
        for d in dtypes:
            p = subprocess.run([sys.executable, __file__, "--_one", d, "--batch", str(a.batch), "--tokens",
                                str(a.tokens)], capture_output=True, text=True, env=env)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
            if not line:
                sys.exit(f"{d}: no result\n{p.stderr[-2000:]}")
            res[d].append(float(line[0].split()[1]))
            print(f"rep {rep} {d:9s} {res[d][-1]:8.1f} tok/s", flush=True)
    med = {d: statistics.median(v) for d, v in res.items()}
    print("median tok/s: " + ", ".join(f"{d} {m:.1f}" for d, m in med.items()))
    print(f"ratio {dtypes[0]}/{dtypes[1]}: {med[dtypes[0]] / med[dtypes[1]]:.2f}x")


if __name__ == "__main__":
    main()
