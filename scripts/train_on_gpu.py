"""The whole training life cycle in ONE process on a GPU machine that has PyTorch + transformers but no Ray / vLLM /
Mooncake (e.g. a borrowed single-GPU box): regenerate target responses -> target features -> train DSpark and the
DFlash baseline -> STS calibration -> evaluation (τ, lossless check, speed vs the fastest no-speculation baseline).

It uses the same pipeline modules as the Ray jobs - prompts/chat template, loss mask, draft vocabulary, anchors,
drafter, losses, the micro-batched gradient step, checkpoint export, calibration, evaluation - only the
orchestration differs: responses come from transformers' `generate` (greedy by default, like jobs.generate),
features from one batched target forward per group of sequences (kept on the GPU: no store), training is a plain
loop instead of Ray Train.  Outputs under --out: responses/ (stage-1 Parquet, usable by jobs.extract elsewhere),
train_<kind>/ (metrics.jsonl, loss_curve.png, drafter/), eval/ (results.json + PNGs), summary.json.

    python scripts/train_on_gpu.py --prompts ../shared/data/train_prompts/*.jsonl \\
        --eval ../shared/data/eval/*.jsonl --out work/gpu
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target HF folder (default: prepared SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", nargs="+", required=True, help="training prompt JSONL files")
    ap.add_argument("--limit-per-file", type=int, default=None, help="prompts per file (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="response cap (as jobs.generate)")
    ap.add_argument("--max-prompt-tokens", type=int, default=1536, help="longer prompts are skipped")
    ap.add_argument("--gen-batch", type=int, default=256, help="prompts per generate call")
    ap.add_argument("--gen-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="target precision for generation and features (fp32: as the CPU pipeline)")
    ap.add_argument("--drafters", default="dspark,dflash", help="kinds to train, comma separated")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=7)
    ap.add_argument("--markov-w1", default="table", choices=["table", "embedding"],
                    help="dspark W1 while training (jobs.train --markov-w1): free table or from the target embedding")
    ap.add_argument("--feature-noise", type=float, default=0.0,
                    help="noise on the injected features while training (jobs.train --feature-noise)")
    ap.add_argument("--epochs", type=float, default=6.0)
    ap.add_argument("--seqs-per-step", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=32)
    ap.add_argument("--num-anchors", type=int, default=64)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--holdout-frac", type=float, default=0.05)
    ap.add_argument("--train-budget-s", type=float, default=150.0,
                    help="wall-clock cap per drafter: training stops early (and says so) when reached")
    ap.add_argument("--eval", nargs="*", default=[], help="benchmark JSONL files (none = skip evaluation)")
    ap.add_argument("--eval-limit", type=int, default=10)
    ap.add_argument("--eval-max-new-tokens", type=int, default=128)
    ap.add_argument("--calib-limit", type=int, default=32, help="held-out prompts rolled out for STS (0 = skip)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--out", type=Path, default=Path("work/gpu"))
    return ap.parse_args(argv)


# ---- stage 1: responses -------------------------------------------------------------------------------------------
@torch.no_grad()
def generate_responses(model, tok, requests: list[dict], max_new_tokens: int, batch: int, device) -> list[dict]:
    """Greedy responses, longest prompts first, left-padded batches.  The response keeps the end-of-turn token."""
    from pipeline.prompts import end_of_turn_ids
    from pipeline.responses import loss_mask_for

    eot = end_of_turn_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eot[0]
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i]["prompt_ids"]))
    rows = [None] * len(requests)
    for b0 in range(0, len(order), batch):
        idx = order[b0:b0 + batch]
        L = max(len(requests[i]["prompt_ids"]) for i in idx)
        ids = torch.full((len(idx), L), pad, dtype=torch.long)
        att = torch.zeros((len(idx), L), dtype=torch.long)
        for j, i in enumerate(idx):
            p = requests[i]["prompt_ids"]
            ids[j, L - len(p):] = torch.tensor(p)
            att[j, L - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eot, pad_token_id=pad)
        gen = out[:, L:].cpu().tolist()
        for j, i in enumerate(idx):
            g, finish = gen[j], "length"
            for k, t in enumerate(g):
                if t in eot:
                    g, finish = g[:k + 1], "stop"
                    break
            r = requests[i]
            rows[i] = dict(request_id=r["request_id"], source_file=r["source_file"], prompt_ids=r["prompt_ids"],
                           response_ids=g, loss_mask=loss_mask_for(len(r["prompt_ids"]), len(g)),
                           finish_reason=finish)
        log(f"generate: {min(b0 + batch, len(order))}/{len(order)} prompts")
    return rows


# ---- stage 2: features ----------------------------------------------------------------------------------------------
def extract_features(model, rows: list[dict], layer_ids: list[int], lm_head: torch.Tensor,
                     tokens_per_batch: int = 65536) -> dict[str, dict]:
    """pipeline.hf_extractor over groups of similar-length sequences (one forward each), kept on the model's
    device.  The same tensors a stage-2 store holds: aux_hidden / last_hidden bf16, target_lse fp32 from the bf16
    last state."""
    from pipeline.hf_extractor import HFExtractor
    from pipeline.stores.base import full_vocab_lse

    ex = HFExtractor(model, layer_ids)
    samples = {}
    order = sorted(rows, key=lambda r: -(len(r["prompt_ids"]) + len(r["response_ids"])))
    i = 0
    while i < len(order):
        group = order[i:i + max(1, tokens_per_batch // (len(order[i]["prompt_ids"]) + len(order[i]["response_ids"])))]
        i += len(group)
        seqs = [r["prompt_ids"] + r["response_ids"] for r in group]
        with torch.no_grad():
            for r, s, (aux, last) in zip(group, seqs, ex.extract_batch(seqs)):
                samples[r["request_id"]] = dict(
                    input_ids=torch.tensor(s, dtype=torch.int32),
                    loss_mask=torch.tensor(r["loss_mask"], dtype=torch.uint8),
                    aux_hidden=aux.contiguous(), last_hidden=last.contiguous(),
                    target_lse=full_vocab_lse(last.float(), lm_head))
    return samples


# ---- stage 3: training ----------------------------------------------------------------------------------------------
def train_drafter(kind: str, args, target: Path, layer_ids, draft_ids: list[int], samples: dict, train_ids: list[str],
                  device) -> Path:
    from pipeline.dspark.checkpoint import export_checkpoint
    from pipeline.target_weights import load_target_weights
    from pipeline.dspark.drafter import DSparkDrafter
    from pipeline.dspark.losses import LossConfig, TargetHead
    from pipeline.training import (TrainConfig, accumulate_gradients, append_metrics, build_drafter_config,
                                   lr_lambda, metrics_row, plot_metrics, step_blocks, step_sample_ids,
                                   step_seed)

    run = args.out / f"train_{kind}"
    run.mkdir(parents=True, exist_ok=True)
    tcfg = TrainConfig(drafter=kind, num_layers=args.num_layers, block_size=args.block_size,
                       num_anchors=args.num_anchors, seqs_per_step=args.seqs_per_step, lr=args.lr, seed=args.seed,
                       markov_w1=args.markov_w1)
    torch.manual_seed(args.seed)
    dcfg = build_drafter_config(tcfg, target, layer_ids, len(draft_ids))
    model = DSparkDrafter.from_target(dcfg, target, draft_ids=torch.tensor(draft_ids)).to(device)
    params = model.trainable_parameters()
    loss_cfg = LossConfig(kind=kind, distance=tcfg.distance, decay=tcfg.decay_value())
    need_target = loss_cfg.dist_weight > 0 or loss_cfg.conf_weight > 0
    head = TargetHead(load_target_weights(target).lm_head.to(device), model.draft_ids) if need_target else None
    opt = torch.optim.AdamW(params, lr=tcfg.lr, weight_decay=tcfg.weight_decay, fused=True)
    total = max(1, math.ceil(args.epochs * len(train_ids) / args.seqs_per_step))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, tcfg.warmup_frac))
    metrics = run / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    t_start, t_last, pos_since = time.time(), time.time(), 0
    log(f"train {kind}: {len(train_ids)} sequences, {total} steps of {args.seqs_per_step}, draft vocab "
        f"{len(draft_ids)}, {sum(p.numel() for p in params) / 1e6:.1f}M trainable parameters")
    step = 0
    for step in range(total):
        batch = [samples[i] for i in step_sample_ids(train_ids, step, args.seqs_per_step, 1, 0, args.seed)]
        blocks, wsum = step_blocks(batch, args.num_anchors, args.block_size, loss_cfg.decay, args.seed, 0, step)
        denom = max(wsum, 1e-12)
        opt.zero_grad(set_to_none=True)
        parts, n_sup, acc = accumulate_gradients(model, head, batch, blocks, loss_cfg, denom, args.micro_batch,
                                                 device=device, feature_noise=args.feature_noise,
                                                 noise_seed=step_seed(args.seed, 0, step, "noise:"))
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip))
        opt.step()
        sched.step()
        pos_since += n_sup
        over = time.time() - t_start > args.train_budget_s
        if (step + 1) % 20 == 0 or step + 1 == total or over:
            dt = time.time() - t_last
            row = metrics_row(step + 1, sched.get_last_lr()[0], gnorm, pos_since, dt, n_sup, parts, acc)
            append_metrics(metrics, row)
            log(f"train {kind}: step {step + 1}/{total} " + " ".join(f"{k} {v:.4f}" for k, v in parts.items())
                + f" acc1 {row['acc_top1_first']:.3f} | {row['positions_per_s']:.0f} pos/s")
            t_last, pos_since = time.time(), 0
        if over:
            log(f"train {kind}: STOPPED EARLY at step {step + 1}/{total} (--train-budget-s {args.train_budget_s})")
            break
    plot_metrics(metrics, run / "loss_curve.png")
    path = export_checkpoint(model.float().cpu(), run / "drafter", verifier_name_or_path=str(target))
    (run / "train_summary.json").write_text(json.dumps(dict(
        kind=kind, steps_done=step + 1, steps_planned=total, seconds=time.time() - t_start,
        sequences=len(train_ids), seqs_per_step=args.seqs_per_step, draft_vocab_size=len(draft_ids)), indent=1))
    return path


def main(argv=None):
    args = parse_args(argv)
    from pipeline.runtime import apply_env, resolve_device

    apply_env()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.dspark.draft_vocab import build_draft_vocab, count_tokens
    from pipeline.prompts import read_prompt_files, tokenize_requests
    from pipeline.responses import RESPONSE_SCHEMA
    from pipeline.shards import ShardSet, atomic_write_json
    from pipeline.target_model import default_aux_layer_ids, resolve_target
    from pipeline.training import special_token_ids, split_ids

    device = torch.device(resolve_device(args.device))
    args.out.mkdir(parents=True, exist_ok=True)
    target = resolve_target(args.target)
    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, args.gen_dtype)).to(device).eval()
    log(f"target {target} on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'})")

    # 1. responses
    prompt_rows, skips = read_prompt_files(args.prompts, limit_per_file=args.limit_per_file)
    requests, long_skips = tokenize_requests(tok, prompt_rows, args.max_prompt_tokens)
    log(f"{len(requests)} prompts ({len(skips) + len(long_skips)} skipped)")
    t = time.time()
    rows = generate_responses(model, tok, requests, args.max_new_tokens, args.gen_batch, device)
    n_gen = sum(len(r["response_ids"]) for r in rows)
    gen_s = time.time() - t
    log(f"generated {n_gen} tokens in {gen_s:.1f}s ({n_gen / gen_s:.0f} tok/s)")
    import pyarrow as pa

    shards = ShardSet(args.out / "responses", key="request_id")
    if not shards.has_manifest():
        for b in range(0, len(rows), 256):
            shards.write_shard(pa.Table.from_pylist(rows[b:b + 256], schema=RESPONSE_SCHEMA))
        shards.write_manifest(dict(target=str(target), generator="transformers.generate (scripts/train_on_gpu.py)",
                                   max_new_tokens=args.max_new_tokens, temperature=0.0, complete=True))

    # 2. features
    L = model.config.num_hidden_layers
    layer_ids = default_aux_layer_ids(L)
    lm_head = model.get_output_embeddings().weight.detach().float()
    t = time.time()
    samples = extract_features(model, rows, layer_ids, lm_head)
    n_tok = sum(int(s["input_ids"].shape[0]) for s in samples.values())
    ext_s = time.time() - t
    log(f"features of {n_tok} tokens in {ext_s:.1f}s; layers {layer_ids}")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # 3. draft vocabulary from the training responses, then train each drafter
    ids = sorted(samples)
    train_ids, hold_ids = split_ids(ids, args.holdout_frac)
    V = lm_head.shape[0]
    counts = count_tokens(((samples[i]["input_ids"], samples[i]["loss_mask"]) for i in train_ids), V)
    dv = build_draft_vocab(counts, coverage=0.99, always_include=special_token_ids(target, V), multiple_of=64)
    log(dv.report())
    summary = dict(device=str(device), gpu=torch.cuda.get_device_name() if device.type == "cuda" else None,
                   prompts=len(requests), responses=len(rows), generated_tokens=n_gen, generate_seconds=gen_s,
                   feature_tokens=n_tok, feature_seconds=ext_s, train_sequences=len(train_ids),
                   holdout_sequences=len(hold_ids), draft_vocab=dv.report(), drafters={})
    paths = {}
    for kind in [k.strip() for k in args.drafters.split(",") if k.strip()]:
        paths[kind] = train_drafter(kind, args, target, layer_ids, dv.draft_ids.tolist(), samples, train_ids, device)
        summary["drafters"][kind] = json.loads((paths[kind].parent / "train_summary.json").read_text())
        atomic_write_json(args.out / "summary.json", summary)
    del samples
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # 4. STS calibration of the confidence head on held-out prompts
    if "dspark" in paths and args.calib_limit > 0 and hold_ids:
        from pipeline.sts_rollouts import CalibrateConfig, run_calibration

        texts = {r.request_id: r.text for r in prompt_rows}
        hp = args.out / "heldout_prompts.jsonl"
        hp.write_text("".join(json.dumps({"prompt": texts[i]}) + "\n" for i in hold_ids if i in texts))
        rep = run_calibration(CalibrateConfig(drafter=paths["dspark"], prompts=[hp], target=str(target),
                                              limit=args.calib_limit, max_new_tokens=128, batch=16,
                                              device=str(device)))
        summary["calibration"] = {k: rep[k] for k in ("rounds", "sts_temperatures", "before", "after")}
        log(f"STS: ECE before {rep['before']['ece']} after {rep['after']['ece']}")
        atomic_write_json(args.out / "summary.json", summary)

    # 5. evaluation: every system on the same prompts, side by side
    if args.eval:
        from pipeline.evaluation import EvalConfig, run_evaluation

        spec_dtype = "bfloat16" if device.type == "cuda" else "float32"
        res = run_evaluation(EvalConfig(drafter=[f"{k}={p}" for k, p in paths.items()],
                                        benchmarks=[Path(b) for b in args.eval], out=args.out / "eval",
                                        target=str(target), limit=args.eval_limit,
                                        max_new_tokens=args.eval_max_new_tokens, spec_dtype=spec_dtype,
                                        baseline_dtypes=["float32", "bfloat16"], device=str(device)))
        summary["eval"] = {name: {k: s.get(k) for k in ("tau", "tokens_per_s", "speedup_vs_fastest_baseline",
                                                        "greedy_mismatches_vs_baseline")}
                           for name, s in res["overall"].items()}
        summary["eval_per_benchmark_tau"] = {b: {n: s.get("tau") for n, s in r.items()}
                                             for b, r in res["benchmarks"].items()}
        log(json.dumps(summary["eval"], indent=1))
    summary["total_seconds"] = time.time() - T0
    atomic_write_json(args.out / "summary.json", summary)
    log(f"done: {args.out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    from pipeline.runtime import reexec_for_process_env

    reexec_for_process_env()
    main()
