"""What a verification depth costs at each batch size, and the tau it needs to pay: plain decoding against fixed-depth
speculation (depth k = 1, 2, 3, 7 ...) with N requests decoding at once, in one process (no Serve), interleaved.

    python -m jobs.bench depth_cost --dtype bfloat16:packed --batch 1 16            # random drafter: costs only
    python -m jobs.bench depth_cost --drafter work/g8k/train_dspark/drafter --dtype bfloat16:packed --batch 1 16 \\
        --prompts ../shared/data/eval/gsm8k.jsonl --prompt-limit 32 --max-tokens 64 --passes 2

For every batch size N, one unit of work is N prompts generated together (greedy, `--max-tokens` each, EOS ignored
so the batch stays N rows wide); every system runs every unit once per pass, order alternating.  Per system it
prints tokens/s, the ratio to plain decoding, seconds per engine round and its parts (drafting, target forward,
rejection sampler, the rest), tau (tokens per request per round) and the BREAK-EVEN tau of the depth: round time /
plain round time.  A depth pays at batch N only when the drafter's tau there exceeds it; `--goal R` also prints the
tau needed for R x plain decoding.  With a random drafter (no --drafter) tau is ~1 and only the costs mean anything.
"""
from __future__ import annotations

import torch

from jobs.bench.draft_budget import build_drafter
from jobs.bench.load import add_prompt_arguments, load_prompts
from pipeline.engine import SpecConfig, SpeculativeEngine
from pipeline.prompts import chat_prompt_ids
from pipeline.runtime import torch_threads
from pipeline.sampling import SamplingParams
from pipeline.target_model import resolve_target
from pipeline.target_runner import TargetRunner

NAME = "depth_cost"
HELP = "plain vs fixed depth k at N requests per batch (no Serve): seconds per round, tau, and the break-even tau"


def add_arguments(ap) -> None:
    ap.add_argument("--drafter", help="exported drafter folder (default: random weights, see --draft-vocab)")
    ap.add_argument("--draft-vocab", type=int, default=2496, help="draft vocabulary of the random drafter")
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared SmolLM2 target)")
    ap.add_argument("--dtype", default="float32", help="target precision, as jobs.evaluate --spec-dtype "
                    "(float32, float32:packed, bfloat16, bfloat16:packed ...)")
    ap.add_argument("--drafter-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="drafter precision (auto: bfloat16 with a bfloat16 --dtype on a CPU with native bf16)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="requests decoding at once")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 7], help="fixed verification depths")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--passes", type=int, default=2, help="measured passes (after one warm-up unit per system)")
    ap.add_argument("--goal", type=float, default=1.2, help="also print the tau needed for this x plain decoding")
    ap.add_argument("--threads", type=int, default=2)
    add_prompt_arguments(ap)


def run(args, harness) -> dict:
    if min(args.batch) < 1 or args.passes < 1 or args.max_tokens < 1 or args.goal <= 0:
        raise SystemExit("--batch, --passes and --max-tokens must be >= 1 and --goal > 0")
    from transformers import AutoTokenizer

    torch_threads(args.threads)
    target = resolve_target(args.target)
    tok = AutoTokenizer.from_pretrained(str(target))
    prompts = [chat_prompt_ids(tok, p) for p in load_prompts(args)]
    runner = TargetRunner.from_pretrained(str(target), dtype=args.dtype, device="cpu", max_seq_len=2048)
    drafter = build_drafter(args, target).eval()
    gamma = drafter.cfg.block_size - 1
    depths = sorted({k for k in args.depths if 1 <= k <= gamma})
    if not depths:
        raise SystemExit(f"--depths: none in 1..{gamma} (the drafter's block size - 1)")
    engines = {"plain": SpeculativeEngine(runner, None, SpecConfig(), tokenizer=tok)}
    for k in depths:
        spec = SpecConfig(method=drafter.cfg.kind, num_speculative_tokens=k, scheduler="fixed",
                          draft_sample_method="greedy")
        engines[f"depth {k}"] = SpeculativeEngine(runner, drafter, spec, tokenizer=tok)
    params = SamplingParams(temperature=0.0)
    print(f"target {target.name} ({args.dtype}), drafter {args.drafter or 'random'} "
          f"({str(drafter.fc.weight.dtype)[6:]}, block {drafter.cfg.block_size}), {args.threads} threads, "
          f"{len(prompts)} prompts, {args.max_tokens} tokens per request, {args.passes} passes", flush=True)

    result = {"dtype": args.dtype, "drafter": args.drafter or "random", "max_tokens": args.max_tokens,
              "batches": {}}
    for n in args.batch:
        units = [[prompts[(i + j) % len(prompts)] for j in range(n)] for i in range(0, len(prompts), n)]

        def case(name, n=n, units=units):
            eng = engines[name]

            def one(rep):
                before = eng.timers.to_dict()
                outs = eng.generate(units[rep % len(units)], params, max_tokens=args.max_tokens, ignore_eos=True)
                after = eng.timers.to_dict()
                d = {k: after[k] - before[k] for k in ("steps", "draft_s", "schedule_s", "target_s", "verify_s",
                                                        "total_s")}
                rounds = sum(o.stats.rounds for o in outs)
                emitted = sum(o.stats.emitted for o in outs)
                return {"tokens": sum(len(o.output_ids) for o in outs), "request_rounds": rounds,
                        "emitted": emitted, **d}
            return one

        s = harness.interleave({name: case(name) for name in engines}, args.passes * len(units), warmup=1,
                               label=f"batch {n}")
        rows, per = [], {}
        for name in engines:
            tot = {m: s.total(name, m) for m in ("tokens", "wall_s", "steps", "draft_s", "schedule_s", "target_s",
                                                  "verify_s", "total_s", "request_rounds", "emitted")}
            steps = max(tot["steps"], 1)
            ms = {m: 1e3 * tot[f"{m}_s"] / steps for m in ("draft", "schedule", "target", "verify", "total")}
            ms["other"] = ms["total"] - ms["draft"] - ms["schedule"] - ms["target"] - ms["verify"]
            tau = tot["emitted"] / tot["request_rounds"] if tot["request_rounds"] else 1.0
            per[name] = {"tok_s": tot["tokens"] / tot["wall_s"], "ms_per_round": ms, "rounds": tot["steps"],
                         "tau": tau if name != "plain" else 1.0}
        plain = per["plain"]
        for name, p in per.items():
            p["over_plain"] = p["tok_s"] / plain["tok_s"]
            p["break_even_tau"] = p["ms_per_round"]["total"] / plain["ms_per_round"]["total"]
            m = p["ms_per_round"]
            rows.append([name, f"{p['tok_s']:.1f}", f"{p['over_plain']:.2f}", f"{m['total']:.1f}", f"{m['draft']:.1f}",
                         f"{m['target']:.1f}", f"{m['verify']:.1f}", f"{m['schedule'] + m['other']:.1f}",
                         f"{p['tau']:.2f}", f"{p['break_even_tau']:.2f}", f"{args.goal * p['break_even_tau']:.2f}"])
        harness.table(f"{n} request(s) at once; ms per engine round over all measured passes (prefill rounds included)",
                      ["system", "tok/s", "÷ plain", "ms/round", "draft", "target", "rejection", "rest", "tau",
                       "break-even tau", f"tau for {args.goal:g}x"], rows)
        result["batches"][n] = per
    return result
