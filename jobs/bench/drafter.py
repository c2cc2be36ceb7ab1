"""Micro-benchmark of the drafter at SmolLM2-135M sizes with random weights (no target model needed).

    python -m jobs.bench drafter [--threads 2] [--draft-vocab 8192] [--seq 512] [--anchors 128]

Prints supervised positions/s of full training steps (forward + loss + backward + AdamW) and ms per draft round
(propose, plus extend_context of the verified tokens) at ~300 context tokens, greedy and temperature 1 interleaved.
"""
from __future__ import annotations

import time

import torch

from pipeline.dspark.anchors import make_blocks
from pipeline.dspark.config import DrafterConfig
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.dspark.losses import LossConfig, TargetHead, drafter_loss
from pipeline.ops.sampling import SamplingParams

NAME = "drafter"
HELP = "drafter at SmolLM2-135M sizes, random weights: training positions/s and ms per draft round"

SMOL = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536,
            vocab_size=49152, mask_token_id=2, aux_layer_ids=[2, 15, 28], target_num_layers=30, rope_theta=1e5)


def add_arguments(ap) -> None:
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=96, help="tokens without loss at the start of the sequence")
    ap.add_argument("--anchors", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4, help="measured training steps (after one warm-up step)")
    ap.add_argument("--cached-lse", action="store_true", help="pass precomputed target (lse, mass_out)")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=20, help="measured draft rounds (after two warm-up rounds)")
    ap.add_argument("--kind", default="dspark", choices=["dspark", "dflash"])


def run(args, harness) -> dict:
    if args.steps < 1 or args.rounds < 1:
        raise SystemExit(f"--steps and --rounds must be >= 1, got {args.steps}, {args.rounds}")
    if not 0 <= args.prompt < args.seq:
        raise SystemExit(f"--prompt must be in [0, --seq), got {args.prompt} with --seq {args.seq}")
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
    result = {"kind": args.kind, "layers": args.layers, "draft_vocab": Vd, "trainable_params": n_params,
              "threads": args.threads}

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

    def train_step(rep):
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
        return {"positions": out.num_supervised, "step_s": t3 - t0, "cpu_s": time.process_time() - c0,
                "fwd_s": t1 - t0, "bwd_s": t2 - t1, "opt_s": t3 - t2, "loss": float(out.loss.detach())}

    def show_step(case, rep, v):
        print(f"  train step: {v['positions']:.0f} supervised positions, fwd {1e3 * v['fwd_s']:.0f} ms, "
              f"bwd {1e3 * v['bwd_s']:.0f} ms, opt {1e3 * v['opt_s']:.0f} ms, loss {v['loss']:.3f}")

    s = harness.interleave({"train step": train_step}, args.steps, warmup=1, label="train", on_call=show_step)
    pos, wall, cpu = s.total("train step", "positions"), s.total("train step", "step_s"), s.total("train step",
                                                                                                  "cpu_s")
    print(f"TRAIN: {pos / wall:.0f} supervised positions/s wall, {pos / cpu * args.threads:.0f} per "
          f"{args.threads} CPU-seconds (seq {T}, {args.anchors} anchors, cached target lse: {args.cached_lse})")
    result["train"] = {"positions_per_s": pos / wall, "positions_per_cpu_s": pos / cpu * args.threads,
                       "seq": T, "anchors": args.anchors, "cached_lse": args.cached_lse}

    # ---------------- inference ----------------
    m.eval()
    result["draft_round"] = {}
    rows = []
    for B in (1, 4):
        states = []
        for b in range(B):
            st = m.new_state(capacity=1024)
            m.extend_context(st, torch.randn(args.context + b, 3 * d).to(torch.bfloat16))
            states.append(st)
        anchors = pool[torch.randint(0, Vd, (B,))]

        def draft_round(params, g):
            def one(rep):
                c0 = time.process_time()
                t0 = time.perf_counter()
                m.propose(states, anchors, params, g)
                t1 = time.perf_counter()
                c1 = time.process_time()
                # verified: anchor + 3 accepted drafts -> append 4 tokens of target features per request
                m.extend_contexts(states, [torch.randn(4, 3 * d).to(torch.bfloat16) for _ in states])
                t2 = time.perf_counter()
                for st in states:  # keep the context length constant
                    m.truncate(st, st.length - 4)
                return {"propose_s": t1 - t0, "propose_cpu_s": c1 - c0, "extend_s": t2 - t1}
            return one

        temps = (0.0, 1.0)
        cases = {f"T={t}": draft_round(SamplingParams(temperature=t), torch.Generator().manual_seed(0))
                 for t in temps}
        s = harness.interleave(cases, args.rounds, warmup=2, label=f"draft round batch {B}")
        for t in temps:
            c = f"T={t}"
            med = {k: s.median(c, k) * 1e3 for k in ("propose_s", "propose_cpu_s", "extend_s")}
            result["draft_round"][f"batch {B}, {c}"] = {"propose_ms": med["propose_s"],
                                                         "propose_cpu_ms": med["propose_cpu_s"],
                                                         "extend_context_ms": med["extend_s"]}
            print(f"DRAFT ROUND: batch {B}, ctx {args.context}, T={t}: propose {med['propose_s']:.2f} ms wall / "
                  f"{med['propose_cpu_s']:.2f} ms CPU (median), extend_context {med['extend_s']:.2f} ms")
            rows.append([f"batch {B}, {c}", f"{med['propose_s']:.2f}", f"{med['propose_cpu_s']:.2f}",
                         f"{med['extend_s']:.2f}"])
    harness.table(f"draft round at context {args.context} (medians, ms)",
                  ["case", "propose wall", "propose CPU", "extend_context"], rows)
    return result
