"""What a verification depth costs at each batch size, and the tau it needs to pay: plain decoding against fixed-depth
speculation (depth k = 1, 2, 3, 7 ...) with N requests decoding at once, in one process (no Serve), interleaved.

    python -m jobs.bench depth_cost --dtype bfloat16:packed --batch 1 16            # random drafter: costs only
    python -m jobs.bench depth_cost --drafter work/g8k/train_dspark/drafter --dtype bfloat16:packed --batch 1 16 \\
        --prompts ../shared/data/eval/gsm8k.jsonl --prompt-limit 32 --max-tokens 64 --passes 2

For every batch size N, one unit of work is N prompts generated together (greedy, `--max-tokens` each, EOS ignored),
run round by round; every system runs every unit once per pass, order alternating.  Per system it prints the unit's
tokens/s and its ratio to plain decoding (a static batch: the rounds after the first request finishes run fewer
rows), and, over the rounds with all N requests decoding (what a busy server keeps running): milliseconds per engine
round and its parts (drafting, target forward, rejection sampler, the rest), tau (tokens per request per round), the
BREAK-EVEN tau of the depth (its round time / the plain round time), the tau `--goal R` x plain decoding needs, and
tau / break-even tau: the speed-up over plain decoding at a steady N.  With a random drafter (no --drafter) tau is
~1 and only the costs mean anything.
"""
from __future__ import annotations

import torch

from jobs.bench.draft_budget import add_drafter_arguments, build_drafter
from jobs.bench.load import add_prompt_arguments, load_prompts
from pipeline.engine.cost_table import ProfileSpec, load_or_profile_cost_table
from pipeline.engine.engine import SpecConfig, SpeculativeEngine
from pipeline.engine.scheduler import make_load_aware_scheduler
from pipeline.data.prompts import chat_prompt_ids
from pipeline.core.runtime import torch_threads
from pipeline.ops.sampling import SamplingParams
from pipeline.data.target_model import resolve_target
from pipeline.engine.target_runner import TargetRunner

NAME = "depth_cost"
HELP = "plain vs fixed depth k at N requests per batch (no Serve): seconds per round, tau, and the break-even tau"
PARTS = ("draft_s", "schedule_s", "target_s", "verify_s", "total_s")  # EngineTimers fields, per round


def add_arguments(ap) -> None:
    add_drafter_arguments(ap)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="requests decoding at once")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3, 7], help="fixed verification depths")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--passes", type=int, default=2, help="measured passes (after one warm-up unit per system)")
    ap.add_argument("--schedulers", nargs="*", default=[], choices=["hardware", "async"],
                    help="also run the serving replica's load-aware scheduler(s) on its profiled cost table")
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
    block_size = drafter.cfg.block_size  # num_speculative_tokens <= the block size
    depths = sorted({k for k in args.depths if 1 <= k <= block_size})
    if not depths:
        raise SystemExit(f"--depths: none in 1..{block_size} (the drafter's block size)")
    engines = {"plain": SpeculativeEngine(runner, None, SpecConfig(), tokenizer=tok)}
    for k in depths:
        spec = SpecConfig(method=drafter.cfg.kind, num_speculative_tokens=k, scheduler="fixed",
                          draft_sample_method="greedy")
        engines[f"depth {k}"] = SpeculativeEngine(runner, drafter, spec, tokenizer=tok)
    if args.schedulers:
        cost, _, _ = load_or_profile_cost_table(runner, ProfileSpec(target=str(target), dtype=args.dtype),
                                                drafter.cfg.block_size + 1)
        for kind in args.schedulers:
            spec = SpecConfig(method=drafter.cfg.kind, scheduler=make_load_aware_scheduler(kind, cost),
                              draft_sample_method="greedy")
            engines[kind] = SpeculativeEngine(runner, drafter, spec, tokenizer=tok)
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
                """One unit run step by step: each round timed, its parts from the engine timers; the rounds with
                all n requests decoding (no prefill, none finished yet) are the ones a busy server keeps running."""
                for ids in units[rep % len(units)]:
                    eng.add_request(ids, params, args.max_tokens, ignore_eos=True)
                tokens, full = 0, dict.fromkeys(("rounds", "emitted") + PARTS, 0.0)
                first = True
                while eng.has_unfinished():
                    active, before = eng.num_active(), eng.timers.to_dict()
                    outs = eng.step()
                    after = eng.timers.to_dict()
                    new = sum(len(o.new_ids) for o in outs)
                    tokens += new
                    if active == n and not first:
                        full["rounds"] += 1
                        full["emitted"] += new
                        for part in PARTS:
                            full[part] += after[part] - before[part]
                    first = False
                return {"tokens": tokens, **{f"full_{k}": v for k, v in full.items()}}
            return one

        s = harness.interleave({name: case(name) for name in engines}, args.passes * len(units), warmup=1,
                               label=f"batch {n}")
        rows, per = [], {}
        for name in engines:
            tot = {m: s.total(name, m) for m in ("tokens", "wall_s")}
            full = {k: s.total(name, f"full_{k}") for k in ("rounds", "emitted") + PARTS}
            rounds = max(full["rounds"], 1)
            ms = {k.removesuffix("_s"): 1e3 * full[k] / rounds for k in PARTS}
            ms["rest"] = ms["total"] - ms["draft"] - ms["schedule"] - ms["target"] - ms["verify"]
            per[name] = {"tok_s": tot["tokens"] / tot["wall_s"], "full_rounds": full["rounds"], "ms_per_round": ms,
                         "tau": full["emitted"] / (n * rounds)}
        plain = per["plain"]
        for name, p in per.items():
            p["over_plain"] = p["tok_s"] / plain["tok_s"]
            p["break_even_tau"] = p["ms_per_round"]["total"] / plain["ms_per_round"]["total"]
            p["full_batch_over_plain"] = p["tau"] / p["break_even_tau"]
            m = p["ms_per_round"]
            rows.append([name, f"{p['tok_s']:.1f}", f"{p['over_plain']:.2f}", f"{m['total']:.1f}", f"{m['draft']:.1f}",
                         f"{m['target']:.1f}", f"{m['verify']:.1f}", f"{m['schedule'] + m['rest']:.1f}",
                         f"{p['tau']:.2f}", f"{p['break_even_tau']:.2f}", f"{args.goal * p['break_even_tau']:.2f}",
                         f"{p['full_batch_over_plain']:.2f}"])
        harness.table(f"{n} request(s) at once: tokens/s of the whole unit; ms per round, tau and the ratios over the "
                      f"rounds with all {n} decoding",
                      ["system", "tok/s", "÷ plain", "ms/round", "draft", "target", "rejection", "rest", "tau",
                       "break-even tau", f"tau for {args.goal:g}x", "tau ÷ break-even"], rows)
        result["batches"][n] = per
    return result
