"""The drafting-round cost budget: one drafting round (block forward + sequential loop + confidences) against one
target decode step at the same context length, measured interleaved in one process, with the round's breakdown.

    python -m jobs.bench draft_budget --drafter work/big/train_dspark/drafter [--context 300]
    python -m jobs.bench draft_budget --draft-vocab 2496      # random drafter weights, same shapes

Per repetition (the order alternates, so contention hits all alike): a target forward of 1 new token on a
`--context`-token cache (what plain decoding pays per token; the aux hidden states the drafter needs are returned
as in the engine), one `propose` at batch 1 (greedy), and the context update of a round (`extend_context` of the
verified tokens, --accepted + 1 of them).  Prints the medians, the ratio to the target step (the budget:
<= 25%) and, from a torch.profiler pass, the share of each part of `propose` (its record_function labels).
With a vanilla Markov head `propose` reads the step biases from the head's bias cache (every round starts from the
same anchor, so all hits after the warm-up) and "propose, no bias cache" computes them every step: the two ends of
what real text gives (its hit rate: `jobs.evaluate`'s bias_cache line).
"""
from __future__ import annotations

import torch

from pipeline.dspark.drafter import DSparkDrafter
from pipeline.eval.evaluation import in_drafter_precision, load_drafter_for
from pipeline.core.runtime import torch_threads
from pipeline.ops.sampling import SamplingParams
from pipeline.data.target_model import resolve_target
from pipeline.dspark.config import dflash_layer_ids
from pipeline.engine.target_runner import TargetRunner
from pipeline.dspark.target_weights import load_target_weights
from pipeline.train.config import TrainConfig, build_drafter_config

NAME = "draft_budget"
HELP = "one drafting round (propose + context update) vs one target decode step, interleaved, with its breakdown"

PARTS = ("draft.block_forward", "draft.sequential_loop", "draft.confidence")


def add_drafter_arguments(ap) -> None:
    """The options `build_drafter` reads (--drafter, --draft-vocab, --drafter-dtype) and the target's (--target,
    --dtype); shared with the depth_cost benchmark."""
    ap.add_argument("--drafter", help="exported drafter folder (default: random weights, see --draft-vocab)")
    ap.add_argument("--draft-vocab", type=int, default=2496, help="draft vocabulary of the random drafter")
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared SmolLM2 target)")
    ap.add_argument("--dtype", default="float32", help="target precision, as jobs.evaluate --spec-dtype (float32: "
                    "automatic CPU back end; float32:smallm, float32:hybrid, float32:packed, float32:mkl, bfloat16, "
                    "bfloat16:packed)")
    ap.add_argument("--drafter-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="drafter precision (auto: bfloat16 with a bfloat16 --dtype on a CPU with native bf16, as "
                         "jobs.evaluate --drafter-dtype auto)")


def add_arguments(ap) -> None:
    add_drafter_arguments(ap)
    ap.add_argument("--context", type=int, default=300, help="tokens already in both caches")
    ap.add_argument("--accepted", type=int, default=1, help="accepted drafts per round for the context update")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)


def build_drafter(args, target):
    if args.drafter:
        return load_drafter_for(args.drafter, str(target), args.drafter_dtype, args.dtype)
    tw = load_target_weights(str(target))
    cfg = build_drafter_config(TrainConfig(), target, dflash_layer_ids(tw.num_layers), args.draft_vocab)
    torch.manual_seed(0)
    m = DSparkDrafter(cfg)
    m.set_draft_vocab(torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values)
    m.load_frozen(tw.embed, tw.lm_head)
    return in_drafter_precision(m, args.drafter_dtype, args.dtype)


def run(args, harness) -> dict:
    if args.reps < 1 or args.accepted < 0:
        raise SystemExit(f"--reps must be >= 1 and --accepted >= 0, got {args.reps}, {args.accepted}")
    torch_threads(args.threads)
    target = resolve_target(args.target)
    runner = TargetRunner.from_pretrained(str(target), dtype=args.dtype, device="cpu")
    drafter = build_drafter(args, target).eval()
    layer_ids = drafter.cfg.aux_layer_ids
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, runner.config.vocab_size, (args.context,), generator=g)
    slot = runner.alloc()
    with torch.inference_mode():
        aux = runner.forward([slot], [ctx], logits_last=1, aux_layer_ids=layer_ids).aux_hidden
        state = drafter.new_state(capacity=args.context + 64)
        aux = aux.to(drafter.fc.weight.dtype)
        drafter.extend_context(state, aux)
    anchor = drafter.draft_ids[:1]
    n_new = args.accepted + 1
    params = SamplingParams(temperature=0.0)

    def target_step(rep):
        tok = torch.randint(0, runner.config.vocab_size, (1,), generator=g)
        runner.forward([slot], [tok], logits_last=1, aux_layer_ids=layer_ids)
        runner.truncate(slot, args.context)

    def propose(rep=0):
        drafter.propose([state], anchor, params)

    cache = getattr(drafter.markov_head, "bias_cache", None)

    def propose_uncached(rep):  # every step projects W1[prev] through W2 (the cache's misses)
        drafter.markov_head.bias_cache = None
        try:
            drafter.propose([state], anchor, params)
        finally:
            drafter.markov_head.bias_cache = cache

    def extend(rep):
        drafter.extend_context(state, aux[-n_new:])
        drafter.truncate(state, args.context)

    cases = {"target step": target_step, "propose": propose, "extend_context": extend}
    if cache is not None:  # vanilla head: the step's bias rows come from the cache (all hits: one anchor)
        cases["propose, no bias cache"] = propose_uncached
    with torch.inference_mode():
        s = harness.interleave(cases, args.reps, warmup=3, label="round vs target step")
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(max(10, args.reps // 2)):
                propose()
    med = {k: s.median(k) * 1e3 for k in cases}
    spread = {k: (min(s.values(k)) * 1e3, max(s.values(k)) * 1e3) for k in cases}
    ev = {e.key: e for e in prof.key_averages()}
    part_ms = {p: ev[p].cpu_time_total / ev[p].count / 1e3 for p in PARTS if p in ev}
    prof_total = sum(part_ms.values())

    c = drafter.cfg
    print(f"target {target.name} ({args.dtype}), context {args.context}, {args.threads} threads; drafter "
          f"{'random' if not args.drafter else args.drafter}: {c.kind}, {c.num_hidden_layers} layers, "
          f"V_d {c.draft_vocab_size}, block {c.block_size}, {str(drafter.fc.weight.dtype)[6:]}; {args.reps} "
          "interleaved repetitions")
    for k in cases:
        print(f"  {k:22s} median {med[k]:7.2f} ms  (min {spread[k][0]:.2f}, max {spread[k][1]:.2f})")
    round_share = med["propose"] / med["target step"]
    with_update = (med["propose"] + med["extend_context"]) / med["target step"]
    print(f"drafting round / target step: {round_share:.1%}   (+ context update: {with_update:.1%}; budget 25%)")
    print("breakdown of propose (torch.profiler pass, its own overhead included):")
    for p, ms in part_ms.items():
        print(f"  {p:22s} {ms:6.2f} ms  {ms / prof_total:6.1%}")
    harness.compare(s, baseline="target step", scale=1e3, unit="ms")
    return {"target": str(target), "dtype": args.dtype, "context": args.context, "threads": args.threads,
            "drafter": args.drafter or "random", "median_ms": med, "round_over_target_step": round_share,
            "round_with_update_over_target_step": with_update, "propose_parts_ms": part_ms}
