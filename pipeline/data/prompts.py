"""Prompt files -> tokenized chat requests.

Accepted JSONL rows: ``{"turns": [str, ...]}`` (the first turn is used) or ``{"prompt": str}``.  Bad input never
crashes a run half-way: a missing file is an error before anything starts; a malformed line, an empty prompt or a
prompt longer than the context becomes a *recorded skip* (file, line, reason) that the stage reports and stores.
Request ids are stable across reruns (``<file stem>:<line number>``), which is what makes resuming exact.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

DEFAULT_PROMPTS = Path(__file__).parent / "assets" / "miniature_prompts.jsonl"


@dataclass
class PromptRow:
    request_id: str
    source_file: str
    line: int
    text: str


@dataclass
class Skip:
    request_id: str
    source_file: str
    line: int
    reason: str


def _file_tags(paths: list[Path]) -> list[str]:
    stems = [p.stem for p in paths]
    return [s if stems.count(s) == 1 else f"{s}#{i}" for i, s in enumerate(stems)]


def read_prompt_files(paths: Iterable[str | Path], limit: int | None = None,
                      limit_per_file: int | None = None) -> tuple[list[PromptRow], list[Skip]]:
    """Read prompts in file order.  ``limit`` caps the number of *valid* prompts (over all files, in order);
    ``limit_per_file`` caps each file (the first N valid prompts of each), for a balanced mix of sources."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("no prompt files given")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"prompt file not found: {p}")
    rows: list[PromptRow] = []
    skips: list[Skip] = []
    for path, tag in zip(paths, _file_tags(paths)):
        start = len(rows)
        with open(path, encoding="utf-8") as f:
            for lineno, raw in enumerate(f, 1):
                if limit is not None and len(rows) >= limit:
                    return rows, skips
                if limit_per_file is not None and len(rows) - start >= limit_per_file:
                    break
                if not raw.strip():
                    continue
                rid = f"{tag}:{lineno}"
                try:
                    obj = json.loads(raw)
                except json.JSONDecodeError as e:
                    skips.append(Skip(rid, str(path), lineno, f"malformed JSON: {e.msg} at column {e.colno}"))
                    continue
                text = None
                if isinstance(obj, dict):
                    turns = obj.get("turns")
                    if isinstance(turns, list) and turns:
                        text = turns[0]
                    elif "prompt" in obj:
                        text = obj["prompt"]
                if not isinstance(text, str):
                    skips.append(Skip(rid, str(path), lineno, 'no usable prompt: expected {"turns": [str, ...]} or {"prompt": str}'))
                    continue
                if not text.strip():
                    skips.append(Skip(rid, str(path), lineno, "empty prompt"))
                    continue
                rows.append(PromptRow(rid, str(path), lineno, text))
    return rows, skips


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The chat template applied to one user turn, with the generation prompt, as token ids."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn (EOS of the tokenizer and of the generation config)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for tok in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None and tid >= 0:
            ids.add(tid)
    return sorted(ids)


def tokenize_requests(tokenizer, rows: list[PromptRow], max_prompt_tokens: int) -> tuple[list[dict], list[Skip]]:
    """Rows -> request dicts with prompt_ids; prompts longer than ``max_prompt_tokens`` become skips."""
    out, skips = [], []
    for r in rows:
        ids = chat_prompt_ids(tokenizer, r.text)
        if len(ids) > max_prompt_tokens:
            skips.append(Skip(r.request_id, r.source_file, r.line,
                              f"prompt has {len(ids)} tokens, longer than the context allows ({max_prompt_tokens})"))
            continue
        out.append({"request_id": r.request_id, "source_file": r.source_file, "prompt_ids": ids})
    return out, skips
