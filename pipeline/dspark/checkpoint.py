"""Export / load a drafter as a speculators-format folder (docs: docs/checkpoint_format.md).

    <folder>/config.json         speculators config ("speculators_model_type": "dspark", no top-level model_type)
    <folder>/model.safetensors   fc, hidden_norm, layers.N.*, norm, markov_head.*, confidence_head.proj.* (fp32),
                                 lm_head.weight + d2t + t2d only when V_d < V; embed_tokens never (shared with the
                                 target)

Our own extras live under config["dspark_ray"] (drafter kind, STS temperatures, context window, ...); vLLM ignores
them.  vLLM implements only the vanilla Markov head: gated / RNN checkpoints load with `load_drafter` but NOT in
vLLM (an extra `markov_head.gate_proj.*` raises there) -- export records and prints that.

`load_drafter(path, target)` re-attaches the frozen embedding / LM head from the target and validates everything
against it, failing with a `CheckpointError` that says what is wrong.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from pipeline.dspark.draft_vocab import d2t_from_draft_ids, draft_ids_from_d2t
from pipeline.dspark.drafter import DSparkDrafter
from pipeline.core.file_lock import sweep_temporaries, temporary_name
from pipeline.dspark.target_weights import CONFIG_NAME, WEIGHTS_NAME, load_target_weights
from pipeline.dspark.config import DrafterConfig, DrafterConfigError

EXTRA_KEY = "dspark_ray"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------------------------
def speculators_config(cfg: DrafterConfig, verifier_name_or_path: str = "", verifier_architectures=None,
                       dtype: torch.dtype = torch.bfloat16) -> dict:
    dtype_name = str(dtype).removeprefix("torch.")
    layer = {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,  # non-causal block attention in vLLM
        "is_neox_style": True,
        "dtype": dtype_name,
    }
    vllm_ok = cfg.markov_rank > 0 and cfg.markov_head_type == "vanilla"
    notes = []
    if cfg.markov_rank == 0:
        notes.append("markov_rank=0 (DFlash baseline): vLLM's dspark loader requires markov_rank > 0; this "
                     "checkpoint loads with pipeline.dspark.checkpoint.load_drafter (our engine) only")
    elif cfg.markov_head_type != "vanilla":
        notes.append(f"markov_head_type={cfg.markov_head_type!r}: vLLM implements only the vanilla Markov head; "
                     "this checkpoint loads with pipeline.dspark.checkpoint.load_drafter but not in vLLM")
    if cfg.context_window is not None:
        notes.append(f"context_window={cfg.context_window} is not expressed for vLLM (it attends to the full "
                     "context); serve with our engine to match training")
    if cfg.sts_temperatures is not None:
        notes.append("vLLM has no calibration field: it uses raw confidences (no STS)")
    return {
        "architectures": ["DSparkDraftModel"],
        "speculators_model_type": "dspark",
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": "dspark",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path,
                         "architectures": list(verifier_architectures or [])},
        },
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "use_aux_hidden_state": True,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": True,
        "markov_rank": cfg.markov_rank,
        "markov_head_type": cfg.markov_head_type,
        "enable_confidence_head": cfg.enable_confidence_head,
        "confidence_head_with_markov": bool(cfg.enable_confidence_head and cfg.confidence_head_with_markov),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "sliding_window_non_causal": False,
        "dtype": dtype_name,
        EXTRA_KEY: {
            "format_version": FORMAT_VERSION,
            "kind": cfg.kind,
            "sts_temperatures": cfg.sts_temperatures,
            "context_window": cfg.context_window,
            "target_num_layers": cfg.target_num_layers,
            "vllm_compatible": vllm_ok,
            "notes": notes,
            "extra": cfg.extra,
        },
    }


def checkpoint_tensors(drafter: DSparkDrafter, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors of the exported checkpoint (names per docs/checkpoint_format.md §3)."""
    cfg = drafter.cfg
    out = {}
    head = drafter.markov_head
    for name, t in drafter.state_dict().items():
        if name.startswith("embed_tokens.") or name == "markov_head.markov_w1_proj.weight":
            continue  # embed: shared with the target; W1's projection: folded into the table below
        if name == "markov_head.markov_w1.weight":
            t = head.materialize_w1()  # markov_w1_source "embedding": rmsnorm(E) P^T + R, else W1 itself
        if name.startswith("lm_head.") and cfg.full_vocab:
            continue
        keep_fp32 = name.startswith("confidence_head.")
        out[name] = t.detach().to("cpu", torch.float32 if keep_fp32 else dtype).contiguous().clone()
    if not cfg.full_vocab:
        out["d2t"] = d2t_from_draft_ids(drafter.draft_ids.cpu()).contiguous()
        # speculators' from_pretrained needs t2d (bool [V]) for a reduced vocab: it is a registered buffer there, and
        # without it the buffer stays uninitialised and re-selecting the verifier lm_head rows fails; vLLM skips it
        out["t2d"] = _t2d_mask(drafter.draft_ids.cpu(), cfg.vocab_size)
    return out


def _t2d_mask(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """speculators' t2d: bool [V], True at the target ids that are in the draft vocabulary."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids.long()] = True
    return t2d


def export_checkpoint(drafter: DSparkDrafter, path, verifier_name_or_path: str = "", verifier_architectures=None,
                      dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the folder atomically (temp folder in the same parent, then rename over `path`).  Returns `path`.
    The temporary names carry the writer's pid (pipeline.core.file_lock.temporary_name), so what an export killed half-way
    left is swept by the next export to the same path."""
    from safetensors.torch import save_file

    cfg = drafter.cfg
    path = Path(path).resolve()
    config = speculators_config(cfg, verifier_name_or_path, verifier_architectures, dtype)
    for note in config[EXTRA_KEY]["notes"]:
        print(f"[checkpoint] NOTE: {note}")
    if not config[EXTRA_KEY]["vllm_compatible"]:
        warnings.warn(f"export_checkpoint: {config[EXTRA_KEY]['notes'][0]}", stacklevel=2)
    tensors = checkpoint_tensors(drafter, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_temporaries(path.parent, path.name)
    tmp = temporary_name(path)
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if path.exists():
            old = temporary_name(path)
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# ---------------------------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------------------------
def read_config(path) -> DrafterConfig:
    """config.json -> DrafterConfig (validated)."""
    path = Path(path)
    f = path / CONFIG_NAME
    if not f.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_NAME} -- not a drafter checkpoint folder")
    try:
        c = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f}: unreadable JSON ({e})") from None
    if c.get("speculators_model_type") != "dspark":
        raise CheckpointError(f"{f}: speculators_model_type is {c.get('speculators_model_type')!r}, expected 'dspark'")
    try:
        L = c["transformer_layer_config"]
        ext = c.get(EXTRA_KEY, {})
        kind = ext.get("kind", "dspark" if c["markov_rank"] > 0 else "dflash")
        if c.get("target_hidden_size") not in (None, L["hidden_size"]):
            raise CheckpointError(f"{f}: target_hidden_size {c['target_hidden_size']} != draft hidden size "
                                  f"{L['hidden_size']} (unsupported: the draft must be as wide as the target)")
        rope = L.get("rope_theta") or (L.get("rope_parameters") or {}).get("rope_theta") or 1e6
        return DrafterConfig(
            hidden_size=L["hidden_size"], num_attention_heads=L["num_attention_heads"],
            num_key_value_heads=L["num_key_value_heads"],
            head_dim=L.get("head_dim") or L["hidden_size"] // L["num_attention_heads"],
            intermediate_size=L["intermediate_size"], vocab_size=L["vocab_size"], mask_token_id=c["mask_token_id"],
            aux_layer_ids=c["aux_hidden_state_layer_ids"], num_hidden_layers=L["num_hidden_layers"],
            rms_norm_eps=L.get("rms_norm_eps", 1e-6), rope_theta=float(rope),
            max_position_embeddings=L.get("max_position_embeddings", 32768),
            draft_vocab_size=c.get("draft_vocab_size") or L["vocab_size"], block_size=c["block_size"], kind=kind,
            markov_rank=c["markov_rank"], markov_head_type=c.get("markov_head_type", "vanilla"),
            enable_confidence_head=c.get("enable_confidence_head", False),
            confidence_head_with_markov=c.get("confidence_head_with_markov", False),
            sts_temperatures=ext.get("sts_temperatures"), target_num_layers=ext.get("target_num_layers"),
            context_window=ext.get("context_window"), hidden_act=L.get("hidden_act", "silu"),
            attention_bias=L.get("attention_bias", False), extra=ext.get("extra") or {},
        )
    except KeyError as e:
        raise CheckpointError(f"{f}: missing field {e}") from None
    except DrafterConfigError as e:
        raise CheckpointError(f"{f}: invalid drafter config: {e}") from None


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    f = path / WEIGHTS_NAME
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            out = {}
            for name in files:
                out.update(load_file(str(path / name)))
            return out
        if not f.is_file():
            raise CheckpointError(f"{path}: no {WEIGHTS_NAME}")
        return load_file(str(f))
    except CheckpointError:
        raise
    except Exception as e:  # SafetensorError, OSError, JSON errors: truncated / corrupt file
        raise CheckpointError(f"{path}: cannot read the weights ({type(e).__name__}: {e}) -- the file is corrupt or "
                              "truncated; re-export the checkpoint") from None


def load_drafter(path, target, dtype: torch.dtype = torch.float32, device="cpu",
                 check_lm_head: bool = True) -> DSparkDrafter:
    """Load an exported folder and re-attach the frozen embedding / LM head from `target` (model or HF folder).

    Validates: config fields, target hidden size / vocab / layer count, every tensor present with the right shape,
    no unknown tensors, d2t consistent, and (check_lm_head) that the stored draft-vocab LM head equals the target's
    rows (catches a checkpoint trained against a different target).
    """
    path = Path(path)
    cfg = read_config(path)
    tw = load_target_weights(target)
    if tw.hidden_size != cfg.hidden_size:
        raise CheckpointError(f"{path}: drafter was trained for a target with hidden size {cfg.hidden_size}, but the "
                              f"target {tw.name_or_path!r} has hidden size {tw.hidden_size}")
    if tw.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{path}: drafter expects a target vocabulary of {cfg.vocab_size}, but the target "
                              f"{tw.name_or_path!r} has {tw.vocab_size}")
    if max(cfg.aux_layer_ids) > tw.num_layers:
        raise CheckpointError(f"{path}: aux_hidden_state_layer_ids {cfg.aux_layer_ids} need a target with >= "
                              f"{max(cfg.aux_layer_ids)} layers; the target has {tw.num_layers}")
    if cfg.target_num_layers is not None and cfg.target_num_layers != tw.num_layers:
        warnings.warn(f"{path}: trained for a {cfg.target_num_layers}-layer target, loading with a "
                      f"{tw.num_layers}-layer one", stacklevel=2)

    tensors = _load_tensors(path)
    model = DSparkDrafter(cfg)
    if not cfg.full_vocab:
        if "d2t" not in tensors:
            raise CheckpointError(f"{path}: draft_vocab_size {cfg.draft_vocab_size} < vocab {cfg.vocab_size} but "
                                  "the d2t tensor is missing")
        d2t = tensors.pop("d2t")
        if tuple(d2t.shape) != (cfg.draft_vocab_size,):
            raise CheckpointError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({cfg.draft_vocab_size},)")
        try:
            model.set_draft_vocab(draft_ids_from_d2t(d2t))
        except ValueError as e:
            raise CheckpointError(f"{path}: invalid d2t: {e}") from None
    t2d = tensors.pop("t2d", None)  # optional (older exports lack it), derived from d2t: must agree
    if t2d is not None and not torch.equal(t2d.bool().flatten(), _t2d_mask(model.draft_ids.cpu(), cfg.vocab_size)):
        raise CheckpointError(f"{path}: t2d does not match d2t (expected a bool [{cfg.vocab_size}] mask of the "
                              f"{cfg.draft_vocab_size} draft-vocabulary target ids)")

    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("embed_tokens.")
                and not (cfg.full_vocab and k.startswith("lm_head."))}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k}: {tuple(tensors[k].shape)} != {tuple(v.shape)}" for k, v in expected.items()
             if k in tensors and tuple(tensors[k].shape) != tuple(v.shape)]
    if missing or unexpected or wrong:
        msg = [f"{path}: checkpoint tensors do not match the config"]
        if missing:
            msg.append(f"missing: {missing}")
        if unexpected:
            msg.append(f"unexpected: {unexpected}")
        if wrong:
            msg.append(f"wrong shape: {wrong}")
        raise CheckpointError("; ".join(msg))
    if check_lm_head and "lm_head.weight" in tensors:
        stored = tensors["lm_head.weight"]
        rows = tw.lm_head[model.draft_ids.to(tw.lm_head.device)].to(stored.dtype)
        if not torch.allclose(stored.float(), rows.float(), rtol=1e-2, atol=1e-3):
            raise CheckpointError(f"{path}: the stored lm_head does not equal the target's LM-head rows of the draft "
                                  f"vocabulary -- was this drafter trained for target {tw.name_or_path!r}?")
    with torch.no_grad():
        sd = model.state_dict()
        for k, t in tensors.items():
            sd[k].copy_(t)
    model.load_frozen(tw.embed, tw.lm_head)
    if "lm_head.weight" in tensors:  # keep exactly what was exported (bitwise round trip)
        with torch.no_grad():
            model.lm_head.weight.copy_(tensors["lm_head.weight"])
    model = model.to(device=device, dtype=dtype)
    model.eval()
    return model
