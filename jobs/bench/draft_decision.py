"""Algorithm 1's draft-or-not decision, single stream: the plain decoder, fixed depth and the hardware-aware
scheduler with the decision averaged over drafted rounds (``Algorithm1(gain_ema=...)``, one case per
``--gain-ema`` value; ``none`` = the last round alone decides), interleaved per prompt (rotating order), greedy.

    python -m jobs.bench draft_decision --drafter work/recipe/train_dspark/drafter \\
        --prompts ../shared/data/eval/gsm8k.jsonl --limit 16 --max-tokens 128 --gain-ema none 0.1 0.3

Prints tokens/s, the ratio to the plain decoder, τ and the number of rounds per case.  The target runs in
--dtype (default bfloat16:packed where the CPU has native bf16, else float32), the drafter in the precision
jobs.evaluate's --drafter-dtype auto picks for it.
"""
from __future__ import annotations

import time
from pathlib import Path

from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.eval.evaluation import load_benchmark, load_drafter_for
from pipeline.core.runtime import cpu_has_native_bf16, torch_threads
from pipeline.ops.sampling import SamplingParams
from pipeline.engine.cost_table import CostTable
from pipeline.engine.scheduler import Algorithm1
from pipeline.data.target_model import resolve_target
from pipeline.engine.target_runner import TargetRunner

NAME = "draft_decision"
HELP = "single stream: plain vs fixed depth vs Algorithm 1 with its draft-or-not decision averaged (gain_ema)"


def add_arguments(p) -> None:
    p.add_argument("--drafter", required=True, help="exported DSpark checkpoint folder (with a confidence head)")
    p.add_argument("--prompts", required=True, type=Path, help="benchmark JSONL (e.g. ../shared/data/eval/gsm8k.jsonl)")
    p.add_argument("--limit", type=int, default=16, help="prompts (an even subsample of the file)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--gain-ema", nargs="+", default=["none", "0.1"],
                   help="one hardware-aware case per value: the weight of the averaged gain, or none")
    p.add_argument("--dtype", default=None, help="target precision (default: bfloat16:packed with native bf16, "
                                                 "else float32)")
    p.add_argument("--target", default=None, help="HF folder (default: the prepared SmolLM2 target)")
    p.add_argument("--threads", type=int, default=2)


def run(args, harness) -> dict:
    from transformers import AutoTokenizer

    emas = [None if v.lower() == "none" else float(v) for v in args.gain_ema]
    torch_threads(args.threads)
    target = resolve_target(args.target)
    dtype = args.dtype or ("bfloat16:packed" if cpu_has_native_bf16() else "float32")
    tok = AutoTokenizer.from_pretrained(str(target))
    prompts = load_benchmark(args.prompts, tok, args.limit)
    if not prompts:
        raise SystemExit(f"--prompts {args.prompts}: no usable prompt")
    runner = TargetRunner.from_pretrained(str(target), dtype, device="cpu")
    drafter = load_drafter_for(args.drafter, str(target), "auto", dtype).eval()
    if not drafter.cfg.enable_confidence_head:
        raise SystemExit(f"--drafter {args.drafter}: no confidence head, Algorithm 1 needs one")
    cost = CostTable.profile(runner)
    engines = {"plain": SpeculativeEngine(runner, None, SpecConfig(), tokenizer=tok),
               "fixed": SpeculativeEngine(runner, drafter, SpecConfig(method="dspark", scheduler="fixed"),
                                          tokenizer=tok)}
    for e in emas:
        sch = Algorithm1(cost, gain_ema=e)
        engines[f"hardware@ema={e}"] = SpeculativeEngine(runner, drafter, SpecConfig(method="dspark", scheduler=sch),
                                                         tokenizer=tok)
    greedy = SamplingParams(temperature=0.0)
    stats = {n: None for n in engines}
    tokens = {n: 0 for n in engines}

    def case(name):
        def go(rep):
            out = engines[name].generate([prompts[rep]["prompt_ids"]], greedy, max_tokens=args.max_tokens)[0]
            tokens[name] += len(out.output_ids)
            stats[name] = out.stats if stats[name] is None else stats[name].merge(out.stats)
            return {"tokens": len(out.output_ids)}
        return go

    t0 = time.time()
    s = harness.interleave({n: case(n) for n in engines}, len(prompts), order="rotate", label="per prompt")
    rows, res = [], {}
    base = tokens["plain"] / s.total("plain")
    for n in engines:
        rate = tokens[n] / s.total(n)
        st = stats[n]
        res[n] = {"tokens_per_s": rate, "ratio_to_plain": rate / base, "tau": st.tau if st.rounds else None,
                  "rounds": st.rounds}
        rows.append([n, f"{rate:.2f}", f"{rate / base:.3f}", f"{st.tau:.3f}" if n != "plain" else "-", st.rounds])
    harness.table(f"{args.prompts.stem}, {len(prompts)} prompts x {args.max_tokens} tokens, target {dtype}, "
                  f"drafter {str(drafter.fc.weight.dtype)[6:]} ({time.time() - t0:.0f} s)",
                  ["system", "tok/s", "/ plain", "tau", "rounds"], rows)
    return {"dtype": dtype, "drafter": args.drafter, "prompts": str(args.prompts), "limit": len(prompts),
            "max_tokens": args.max_tokens, "systems": res}
