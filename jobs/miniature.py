"""The miniature run: the whole DSpark life cycle on this machine with a local Ray cluster and the real SmolLM2
target, on the project's small shipped prompt set.

Stages run in order, each the same code as its job (jobs.generate, jobs.extract, ...); a stage whose output is
complete is skipped on a rerun unless --force.  Stages not yet implemented are listed as such in the summary."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.runtime import apply_env


@dataclass
class MiniatureConfig:
    work: Path = field(default=Path("work/miniature"), metadata={"help": "folder for all artifacts of the run"})
    prompts: list[Path] = field(default_factory=list, metadata={
        "help": "prompt JSONL files (default: the project's shipped set of 36 math/code/chat prompts)"})
    target: str | None = field(default=None, metadata={"help": "target HF folder (default: prepared SmolLM2-135M)"})
    max_new_tokens: int = field(default=192, metadata={"help": "response length for generated training data"})
    force: bool = field(default=False, metadata={"help": "rerun stages even if their output is complete"})
    address: str | None = field(default=None, metadata={"help": "Ray address (default: a local ray.init())"})


def main(argv=None):
    apply_env()
    from actors.extraction import ExtractConfig, run_extraction
    from actors.generation import GenerateConfig, run_generation
    from pipeline.config_cli import parse_config
    from pipeline.runtime import init_ray
    from pipeline.shards import ShardSet

    cfg = parse_config(MiniatureConfig, argv, description=__doc__)
    cfg.work.mkdir(parents=True, exist_ok=True)
    init_ray(cfg.address)
    summary = []

    def stage(name, complete, fn):
        t = time.time()
        if complete and not cfg.force:
            summary.append((name, "skipped (complete)", 0.0))
            print(f"=== {name}: complete, skipped (use --force to redo)")
            return
        print(f"=== {name}")
        fn()
        summary.append((name, "done", time.time() - t))

    resp = cfg.work / "responses"
    gen = GenerateConfig(prompts=cfg.prompts, out=resp, target=cfg.target, max_new_tokens=cfg.max_new_tokens,
                         address=cfg.address)
    stage("generate", ShardSet(resp, "request_id").has_manifest(), lambda: run_generation(gen))

    hidden = cfg.work / "hidden"
    ext = ExtractConfig(responses=resp, out=hidden, target=cfg.target, address=cfg.address)
    stage("extract", (hidden / "manifest.json").is_file(), lambda: run_extraction(ext))

    for name in ("train", "calibrate", "evaluate", "serve"):
        summary.append((name, "not implemented yet", 0.0))
    print("\n=== summary")
    print(f"{'stage':<10} {'status':<22} {'seconds':>8}")
    for name, status, sec in summary:
        print(f"{name:<10} {status:<22} {sec:8.1f}")
    print(f"artifacts: {cfg.work.resolve()}")
    return summary


if __name__ == "__main__":
    main()
