"""The target's frozen tensors a drafter shares: the input embedding and the (full-vocabulary) LM head.

Read from a transformers module, or straight from a local HF folder's safetensors without instantiating the model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class TargetWeightsError(RuntimeError):
    pass


@dataclass
class TargetWeights:
    embed: torch.Tensor  # [V, d]
    lm_head: torch.Tensor  # [V, d] (== embed when tied)
    hidden_size: int
    vocab_size: int
    num_layers: int
    name_or_path: str
    architectures: list[str]


def load_target_weights(target) -> TargetWeights:
    """`target`: a transformers causal LM (module) or a local HF folder (reads only the two tensors it needs)."""
    if isinstance(target, torch.nn.Module):
        cfg = target.config
        emb = target.get_input_embeddings().weight.detach()
        out = target.get_output_embeddings()
        head = emb if out is None else out.weight.detach()
        return TargetWeights(emb, head, int(cfg.hidden_size), int(emb.shape[0]), int(cfg.num_hidden_layers),
                             str(getattr(cfg, "_name_or_path", "") or ""), list(getattr(cfg, "architectures", None)
                                                                               or []))
    path = Path(target)
    if not (path / CONFIG_NAME).is_file():
        raise TargetWeightsError(f"target {str(target)!r} is neither a model nor a local HF folder with config.json")
    cfg = json.loads((path / CONFIG_NAME).read_text())
    cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    tensors = _read_named_tensors(path, ["model.embed_tokens.weight", "lm_head.weight"])
    emb = tensors.get("model.embed_tokens.weight")
    if emb is None:  # unusual naming: fall back to instantiating the model
        from transformers import AutoModelForCausalLM

        return load_target_weights(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    head = tensors.get("lm_head.weight", emb)
    return TargetWeights(emb, head, int(cfg["hidden_size"]), int(emb.shape[0]), int(cfg["num_hidden_layers"]),
                         str(path), list(cfg.get("architectures") or []))


def _read_named_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        wmap = json.loads(index.read_text())["weight_map"]
        files = {n: folder / wmap[n] for n in names if n in wmap}
    else:
        f = folder / WEIGHTS_NAME
        if not f.is_file():
            raise TargetWeightsError(f"target folder {folder} has no {WEIGHTS_NAME} (or index)")
        files = {n: f for n in names}
    out = {}
    for n, f in files.items():
        with safe_open(str(f), framework="pt") as sf:
            if n in sf.keys():
                out[n] = sf.get_tensor(n)
    return out
