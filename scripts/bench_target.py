"""Time the TargetRunner forward for B new tokens on a cached context (the SPS(B) curve) and optionally save it as a
CostTable JSON for the hardware-aware scheduler.  Compares with transformers (DynamicCache) for B = 1 and 8.

  python scripts/bench_target.py [--target HF_FOLDER] [--dtype float32|bfloat16] [--context 300] [--out sps.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def hf_time(model, B, context, repeats):
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        pkv = model(torch.randint(0, V, (1, context), generator=g), use_cache=True).past_key_values
        ts = []
        for i in range(repeats + 2):
            x = torch.randint(0, V, (1, B), generator=g)
            t0 = time.perf_counter()
            model(x, past_key_values=pkv, use_cache=True)
            ts.append(time.perf_counter() - t0)
            pkv.crop(-B)
    return statistics.median(ts[2:])


def main(argv=None):
    from pipeline.scheduler import CostTable
    from pipeline.target_model import resolve_target
    from pipeline.target_runner import TargetRunner

    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--out", default=None, help="write the CostTable JSON here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    path = resolve_target(a.target)
    runner = TargetRunner.from_pretrained(path, a.dtype)
    bs = [int(b) for b in a.batch_sizes.split(",")]
    ct = CostTable.profile(runner, bs, context_len=a.context, repeats=a.repeats)
    res = {"target": str(path), "dtype": a.dtype, "context": a.context, "threads": torch.get_num_threads(),
           "runner_ms": {b: round(t * 1e3, 1) for b, t in ct.points}}
    if not a.no_hf:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(path, dtype=runner.dtype).eval()
        res["transformers_ms"] = {b: round(hf_time(m, b, a.context, a.repeats) * 1e3, 1) for b in (1, 8)}
    print(json.dumps(res))
    if a.out:
        ct.save(a.out)


if __name__ == "__main__":
    from pipeline.runtime import reexec_for_process_env

    reexec_for_process_env()
    main()
