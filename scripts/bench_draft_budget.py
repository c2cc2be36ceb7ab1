"""The drafting-round cost budget: one drafting round (block forward + sequential loop + confidences) against one
target decode step at the same context length, measured interleaved in one process, with the round's breakdown.

    .venv/bin/python scripts/bench_draft_budget.py --drafter work/big/train_dspark/drafter [--context 300]
    .venv/bin/python scripts/bench_draft_budget.py --draft-vocab 2496      # random drafter weights, same shapes

Per repetition (the order alternates, so contention hits both alike): a target forward of 1 new token on a
`--context`-token cache (what plain decoding pays per token; the aux hidden states the drafter needs are returned
as in the engine), one `propose` at batch 1 (greedy), and the context update of a round (`extend_context` of the
verified tokens, --accepted + 1 of them).  Prints the medians, the ratio to the target step (the issue's budget:
<= 25%) and, from a torch.profiler pass, the share of each part of `propose` (its record_function labels).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

PARTS = ("draft.block_forward", "draft.sequential_loop", "draft.confidence")


def build_drafter(args, target):
    from pipeline.dspark.checkpoint import load_drafter

    if args.drafter:
        return load_drafter(args.drafter, str(target))
    from pipeline.target_weights import load_target_weights
    from pipeline.dspark.drafter import DSparkDrafter
    from pipeline.target_model import default_aux_layer_ids
    from pipeline.training import TrainConfig, build_drafter_config

    tw = load_target_weights(str(target))
    cfg = build_drafter_config(TrainConfig(), target,
                               default_aux_layer_ids(tw.num_layers), args.draft_vocab)
    torch.manual_seed(0)
    m = DSparkDrafter(cfg)
    m.set_draft_vocab(torch.randperm(cfg.vocab_size)[:cfg.draft_vocab_size].sort().values)
    m.load_frozen(tw.embed, tw.lm_head)
    return m


def main(argv=None):
    from pipeline.runtime import torch_threads
    from pipeline.sampling import SamplingParams
    from pipeline.target_model import resolve_target
    from pipeline.target_runner import TargetRunner

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", help="exported drafter folder (default: random weights, see --draft-vocab)")
    ap.add_argument("--draft-vocab", type=int, default=2496, help="draft vocabulary of the random drafter")
    ap.add_argument("--target", default=None, help="HF folder (default: the prepared SmolLM2 target)")
    ap.add_argument("--dtype", default="float32", help="target precision (float32 = float32:hybrid on CPU; "
                    "float32:packed, float32:mkl)")
    ap.add_argument("--context", type=int, default=300, help="tokens already in both caches")
    ap.add_argument("--accepted", type=int, default=1, help="accepted drafts per round for the context update")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
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
        drafter.extend_context(state, aux)
    anchor = drafter.draft_ids[:1]
    n_new = args.accepted + 1
    params = SamplingParams(temperature=0.0)

    def target_step():
        tok = torch.randint(0, runner.config.vocab_size, (1,), generator=g)
        runner.forward([slot], [tok], logits_last=1, aux_layer_ids=layer_ids)
        runner.truncate(slot, args.context)

    def propose():
        drafter.propose([state], anchor, params)

    def extend():
        drafter.extend_context(state, aux[-n_new:])
        drafter.truncate(state, args.context)

    fns = {"target step": target_step, "propose": propose, "extend_context": extend}
    times = {k: [] for k in fns}
    with torch.inference_mode():
        for r in range(args.reps + 3):
            order = list(fns) if r % 2 == 0 else list(fns)[::-1]
            for k in order:
                t0 = time.perf_counter()
                fns[k]()
                if r >= 3:
                    times[k].append(time.perf_counter() - t0)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(max(10, args.reps // 2)):
                propose()
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    spread = {k: (min(v) * 1e3, max(v) * 1e3) for k, v in times.items()}
    ev = {e.key: e for e in prof.key_averages()}
    part_ms = {p: ev[p].cpu_time_total / ev[p].count / 1e3 for p in PARTS if p in ev}
    prof_total = sum(part_ms.values())

    c = drafter.cfg
    print(f"target {target.name} ({args.dtype}), context {args.context}, {args.threads} threads; drafter "
          f"{'random' if not args.drafter else args.drafter}: {c.kind}, {c.num_hidden_layers} layers, "
          f"V_d {c.draft_vocab_size}, block {c.block_size}; {args.reps} interleaved repetitions")
    for k in fns:
        print(f"  {k:15s} median {med[k]:7.2f} ms  (min {spread[k][0]:.2f}, max {spread[k][1]:.2f})")
    print(f"drafting round / target step: {med['propose'] / med['target step']:.1%}   "
          f"(+ context update: {(med['propose'] + med['extend_context']) / med['target step']:.1%}; budget 25%)")
    print("breakdown of propose (torch.profiler pass, its own overhead included):")
    for p, ms in part_ms.items():
        print(f"  {p:22s} {ms:6.2f} ms  {ms / prof_total:6.1%}")
    return med


if __name__ == "__main__":
    from pipeline.runtime import reexec_for_process_env

    reexec_for_process_env()
    main()
