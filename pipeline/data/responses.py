"""Stage-1 output schema (target responses) and the loss mask rule."""
from __future__ import annotations

import pyarrow as pa

RESPONSE_SCHEMA = pa.schema([
    ("request_id", pa.string()),
    ("source_file", pa.string()),
    ("prompt_ids", pa.list_(pa.int32())),
    ("response_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.uint8())),     # over prompt + response: 1 on assistant tokens incl. end-of-turn
    ("finish_reason", pa.string()),          # "stop" (end of turn / EOS / stop string) or "length"
])

SKIP_SCHEMA = pa.schema([("request_id", pa.string()), ("source_file", pa.string()), ("line", pa.int32()),
                         ("reason", pa.string())])


def loss_mask_for(n_prompt: int, n_response: int) -> list[int]:
    """0 on the prompt (system + user + the assistant header), 1 on every generated token, the end-of-turn token
    included (vLLM's output ids contain the stop token when generation ended on it)."""
    return [0] * n_prompt + [1] * n_response
