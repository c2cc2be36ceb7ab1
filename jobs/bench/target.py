"""Time the TargetRunner forward for B new tokens on a cached context (the SPS(B) curve) and optionally save it as a
CostTable JSON for the hardware-aware scheduler.  Compares with transformers (DynamicCache) for B = 1 and 8.

    python -m jobs.bench target [--target HF_FOLDER] [--dtype float32|bfloat16] [--context 300]
        [--cost-table sps.json]

The runner's curve is CostTable.profile (TargetRunner.time_forwards: interleaved sweeps over all B, medians); the
transformers forwards run --repeats times after two warm-ups (medians)."""
from __future__ import annotations

import json

import torch

from pipeline.engine.cost_table import CostTable
from pipeline.data.target_model import resolve_target
from pipeline.engine.target_runner import TargetRunner

NAME = "target"
HELP = "TargetRunner forward time for B new tokens on a cached context (the SPS(B) cost table) vs transformers"


def add_arguments(ap) -> None:
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--cost-table", default=None, help="also write the CostTable JSON here (the scheduler's input)")


def hf_forward(model, B: int, context: int, repeats: int, harness) -> float:
    """Median seconds of a transformers forward of B new tokens after a ``context``-token DynamicCache."""
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        pkv = model(torch.randint(0, V, (1, context), generator=g), use_cache=True).past_key_values

        def step(rep):
            x = torch.randint(0, V, (1, B), generator=g)
            model(x, past_key_values=pkv, use_cache=True)
            pkv.crop(-B)

        s = harness.interleave({"transformers": step}, repeats, warmup=2, label=f"transformers B={B}")
    return s.median("transformers")


def run(a, harness) -> dict:
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
        res["transformers_ms"] = {b: round(hf_forward(m, b, a.context, a.repeats, harness) * 1e3, 1)
                                  for b in (1, 8)}
    print(json.dumps(res))
    hf = res.get("transformers_ms", {})
    harness.table(f"forward of B new tokens at context {a.context} ({a.dtype}), median ms",
                  ["B", "TargetRunner", "transformers", "transformers / runner"],
                  [[b, f"{t:.1f}", f"{hf[b]:.1f}" if b in hf else "-",
                    f"{hf[b] / t:.2f}" if b in hf and t else "-"] for b, t in res["runner_ms"].items()])
    if a.cost_table:
        ct.save(a.cost_table)
        print(f"cost table: {a.cost_table}")
    return res
