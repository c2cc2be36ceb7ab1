"""Stages 1 and 2 in ONE process with transformers (no Ray, no vLLM), for jobs.train --backend local --prompts on a
machine that has PyTorch + transformers only (one GPU, or a laptop):

    prompts -> greedy responses (``generate``, as jobs.generate's default temperature 0) -> <out>/responses
            -> the target's hidden states (pipeline.data.hf_extractor, one forward per group of similar-length
               sequences) -> the disk store --data, in the layout jobs.extract writes

Both outputs are the ordinary stage formats (stage-1 Parquet shards, a stage-2 disk store whose manifest names the
responses folder), so the later jobs (calibrate, evaluate --heldout-of) read them as they read the Ray jobs'.
A finished store is reused as it is; a finished responses folder is not generated again; an interrupted
extraction continues (stored samples are skipped).
"""
from __future__ import annotations

import random
import time
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.data.hf_extractor import HFExtractor
from pipeline.data.prompts import end_of_turn_ids, read_prompt_files, tokenize_requests
from pipeline.data.responses import RESPONSE_SCHEMA, loss_mask_for
from pipeline.data.shards import ShardSet
from pipeline.ops.layers import full_vocab_lse
from pipeline.stores import DiskHiddenStore, bytes_per_token
from pipeline.data.target_model import resolve_target
from pipeline.dspark.config import parse_layer_ids
from pipeline.train.config import TrainConfig

GENERATOR = "transformers.generate (jobs.train --backend local)"
ROWS_PER_SHARD = 256


@torch.no_grad()
def generate_responses(model, tok, requests: list[dict], max_new_tokens: int, batch: int, device,
                       max_seconds: float | None = None, seed: int = 0) -> list[dict]:
    """Greedy responses (stage-1 rows) in left-padded batches of similar-length prompts, the batches in a seeded
    random order.  A response keeps the end-of-turn token that ended it (finish_reason "stop"), else it is cut at
    max_new_tokens ("length").  With max_seconds no batch after the first starts past that many seconds: the
    prompts of the batches not run are left out of the result."""
    eot = end_of_turn_ids(tok)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eot[0]
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i]["prompt_ids"]))
    batches = [order[b:b + batch] for b in range(0, len(order), batch)]
    random.Random(seed).shuffle(batches)
    rows, t0 = [], time.time()
    for n, idx in enumerate(batches):
        if n and max_seconds is not None and time.time() - t0 > max_seconds:
            print(f"[train] generate: --gen-seconds {max_seconds:g} reached after {len(rows)}/{len(order)} prompts; "
                  f"the other {len(order) - len(rows)} are left out", flush=True)
            break
        L = max(len(requests[i]["prompt_ids"]) for i in idx)
        ids = torch.full((len(idx), L), pad, dtype=torch.long)  # [B, L] left-padded prompts
        att = torch.zeros((len(idx), L), dtype=torch.long)
        for j, i in enumerate(idx):
            p = requests[i]["prompt_ids"]
            ids[j, L - len(p):] = torch.tensor(p)
            att[j, L - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eot, pad_token_id=pad)
        for j, i in enumerate(idx):
            gen, finish = out[j, L:].cpu().tolist(), "length"
            for k, t in enumerate(gen):
                if t in eot:
                    gen, finish = gen[:k + 1], "stop"
                    break
            r = requests[i]
            rows.append(dict(request_id=r["request_id"], source_file=r["source_file"], prompt_ids=r["prompt_ids"],
                             response_ids=gen, loss_mask=loss_mask_for(len(r["prompt_ids"]), len(gen)),
                             finish_reason=finish))
        print(f"[train] generate: {len(rows)}/{len(order)} prompts ({n + 1}/{len(batches)} batches, "
              f"{time.time() - t0:.0f}s)", flush=True)
    return rows


def extract_into_store(extractor: HFExtractor, rows: list[dict], store: DiskHiddenStore, lm_head: torch.Tensor,
                       tokens_per_batch: int = 65536) -> int:
    """The hidden states of every row not yet in `store` (aux_hidden / last_hidden bf16, target_lse fp32 over the
    full vocabulary), groups of similar length in one forward each.  Returns the tokens extracted."""
    done = store.done_ids()
    todo = sorted((r for r in rows if r["request_id"] not in done),
                  key=lambda r: -(len(r["prompt_ids"]) + len(r["response_ids"])))
    i = n_tokens = 0
    while i < len(todo):
        longest = len(todo[i]["prompt_ids"]) + len(todo[i]["response_ids"])
        group = todo[i:i + max(1, tokens_per_batch // longest)]
        i += len(group)
        seqs = [r["prompt_ids"] + r["response_ids"] for r in group]
        for r, s, (aux, last) in zip(group, seqs, extractor.extract_batch(seqs)):
            store.put(r["request_id"], dict(input_ids=torch.tensor(s, dtype=torch.int32),
                                            loss_mask=torch.tensor(r["loss_mask"], dtype=torch.uint8),
                                            aux_hidden=aux.cpu(), last_hidden=last.cpu(),
                                            target_lse=full_vocab_lse(last.float(), lm_head).cpu()))
            n_tokens += len(s)
        print(f"[train] extract: {i}/{len(todo)} sequences", flush=True)
    return n_tokens


def run_local_stages(cfg: TrainConfig, device: torch.device) -> dict:
    """Stages 1-2 for --prompts into <out>/responses and --data (module docstring); returns the store's manifest."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = DiskHiddenStore(cfg.data)
    if store.shards.has_manifest():
        print(f"[train] {cfg.data} holds a finished store: --prompts not generated again", flush=True)
        return store.manifest()
    target = resolve_target(cfg.target)
    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=getattr(torch, cfg.target_dtype))
    model = model.to(device).eval()
    responses = ShardSet(Path(cfg.out) / "responses", key="request_id")
    t0 = time.time()
    if responses.has_manifest():
        rows = list(responses.iter_rows(["request_id", "prompt_ids", "response_ids", "loss_mask"]))
    else:
        prompt_rows, skips = read_prompt_files(cfg.prompts, limit_per_file=cfg.limit_per_file)
        requests, long_skips = tokenize_requests(tok, prompt_rows, cfg.max_prompt_tokens)
        print(f"[train] {len(requests)} prompts ({len(skips) + len(long_skips)} skipped) -> responses on {device}",
              flush=True)
        rows = generate_responses(model, tok, requests, cfg.max_new_tokens, cfg.gen_batch, device,
                                  max_seconds=cfg.gen_seconds, seed=cfg.seed)
        for b in range(0, len(rows), ROWS_PER_SHARD):
            responses.write_shard(pa.Table.from_pylist(rows[b:b + ROWS_PER_SHARD], schema=RESPONSE_SCHEMA))
        responses.write_manifest(dict(target=str(target), generator=GENERATOR, max_new_tokens=cfg.max_new_tokens,
                                      temperature=0.0, num_rows=len(rows), complete=True,
                                      skipped=len(skips) + len(long_skips),
                                      not_answered=len(requests) - len(rows)))
        print(f"[train] {sum(len(r['response_ids']) for r in rows)} response tokens in {time.time() - t0:.1f}s",
              flush=True)
    L = model.config.num_hidden_layers
    layer_ids = parse_layer_ids(None, L)
    hidden = model.config.hidden_size
    lm_head = model.get_output_embeddings().weight.detach().float()
    t0 = time.time()
    n_tokens = extract_into_store(HFExtractor(model, layer_ids), rows, store, lm_head)
    print(f"[train] hidden states of {n_tokens} tokens in {time.time() - t0:.1f}s; layers {layer_ids}", flush=True)
    manifest = store.commit(dict(stage="hidden_states", target=str(target), layer_ids=layer_ids,
                                 num_target_layers=L, hidden_size=hidden, aux_dim=hidden * len(layer_ids),
                                 extractor="hf", compute_dtype=cfg.target_dtype, responses=str(responses.folder),
                                 response_manifest_rows=len(rows), skipped_too_long=[],
                                 bytes_per_token=bytes_per_token(len(layer_ids), hidden, True), target_lse=True))
    store.close()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return manifest
