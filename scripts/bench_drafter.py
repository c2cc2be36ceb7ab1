"""Micro-benchmark of the drafter at SmolLM2-135M sizes with random weights (no target model needed).

    .venv/bin/python scripts/bench_drafter.py [--threads 2] [--draft-vocab 8192] [--seq 512] [--anchors 128]

Prints supervised positions/s of full training steps (forward + loss + backward + AdamW) and ms per draft round
(propose, plus extend_context of the verified tokens) at ~300 context tokens.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pipeline.dspark.anchors import make_blocks  # noqa: E402
from pipeline.dspark.drafter import DSparkDrafter  # noqa: E402
from pipeline.dspark.config import DrafterConfig  # noqa: E402
from pipeline.dspark.losses import LossConfig, TargetHead, drafter_loss  # noqa: E402
from pipeline.sampling import SamplingParams  # noqa: E402

SMOL = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
            vocab_size=49152, mask_token_id=2, aux_layer_ids=[2, 15, 28], target_num_layers=30, rope_theta=1e5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=96, help="tokens without loss at the start of the sequence")
    ap.add_argument("--anchors", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cached-lse", action="store_true", help="pass precomputed target (lse, mass_out)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--kind", default="dspark")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    extra = {} if args.kind == "dspark" else dict(markov_rank=0, enable_confidence_head=False,
                                                  confidence_head_with_markov=False)
    cfg = DrafterConfig(**SMOL, num_hidden_layers=args.layers, draft_vocab_size=args.draft_vocab, block_size=7,
                        kind=args.kind, **extra)
    V, d, Vd = cfg.vocab_size, cfg.hidden_size, cfg.draft_vocab_size
    m = DSparkDrafter(cfg)
    m.set_draft_vocab(torch.randperm(V)[:Vd].sort().values)
    emb = torch.randn(V, d) * 0.02
    m.load_frozen(emb, emb)
    th = TargetHead(emb, m.draft_ids)
    n_params = sum(p.numel() for p in m.trainable_parameters())
    print(f"drafter: {args.layers} layers, d={d}, V={V}, V_d={Vd}, trainable {n_params / 1e6:.1f}M params, "
          f"threads={args.threads}")

    # ---------------- training ----------------
    T = args.seq
    pool = m.draft_ids
    ids = pool[torch.randint(0, Vd, (1, T))]
    lm = torch.ones(1, T, dtype=torch.uint8)
    lm[:, :args.prompt] = 0
    aux = (torch.randn(1, T, 3 * d) * 2).to(torch.bfloat16)
    last = (torch.randn(1, T, d) * 3).to(torch.bfloat16)
    stats = th.stats(last[0].float()) if args.cached_lse else None
    stats = None if stats is None else (stats[0][None], stats[1][None])
    opt = torch.optim.AdamW(m.trainable_parameters(), lr=6e-4, fused=True)  # fused: ~7x faster step on CPU
    lcfg = LossConfig(kind=args.kind)
    gen = torch.Generator().manual_seed(0)
    tot_pos, tot_t, tot_cpu = 0, 0.0, 0.0
    for step in range(args.steps + 1):
        blocks = make_blocks(ids, lm, args.anchors, cfg.block_size, gen)
        c0 = time.process_time()
        t0 = time.perf_counter()
        out = drafter_loss(m, th, aux, ids, last, blocks, lcfg, target_stats=stats)
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        c3 = time.process_time()
        if step == 0:
            continue  # warm-up
        tot_pos += out.num_supervised
        tot_t += t3 - t0
        tot_cpu += c3 - c0
        print(f"  train step: {out.num_supervised} supervised positions, fwd {1e3 * (t1 - t0):.0f} ms, "
              f"bwd {1e3 * (t2 - t1):.0f} ms, opt {1e3 * (t3 - t2):.0f} ms, loss {float(out.loss.detach()):.3f}")
    print(f"TRAIN: {tot_pos / tot_t:.0f} supervised positions/s wall, {tot_pos / tot_cpu * args.threads:.0f} per "
          f"{args.threads} CPU-seconds (seq {T}, {args.anchors} anchors, cached target lse: {args.cached_lse})")

    # ---------------- inference ----------------
    m.eval()
    for B in (1, 4):
        states = []
        for b in range(B):
            st = m.new_state(capacity=1024)
            m.extend_context(st, torch.randn(args.context + b, 3 * d).to(torch.bfloat16))
            states.append(st)
        anchors = pool[torch.randint(0, Vd, (B,))]
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
            times, ext, cpu = [], [], []
            g = torch.Generator().manual_seed(0)
            for r in range(args.rounds + 2):
                c0 = time.process_time()
                t0 = time.perf_counter()
                prop = m.propose(states, anchors, params, g)
                t1 = time.perf_counter()
                c1 = time.process_time()
                # verified: anchor + 3 accepted drafts -> append 4 tokens of target features per request
                m.extend_contexts(states, [torch.randn(4, 3 * d).to(torch.bfloat16) for _ in states])
                t2 = time.perf_counter()
                for st in states:  # keep the context length constant
                    m.truncate(st, st.length - 4)
                if r >= 2:
                    times.append(t1 - t0)
                    ext.append(t2 - t1)
                    cpu.append(c1 - c0)
            times.sort()
            ext.sort()
            cpu.sort()
            print(f"DRAFT ROUND: batch {B}, ctx {args.context}, T={params.temperature}: propose "
                  f"{1e3 * times[len(times) // 2]:.2f} ms wall / {1e3 * cpu[len(cpu) // 2]:.2f} ms CPU (median), "
                  f"extend_context {1e3 * ext[len(ext) // 2]:.2f} ms")


if __name__ == "__main__":
    from pipeline.runtime import reexec_for_process_env

    reexec_for_process_env()
    main()
