"""Causal attention of a ragged batch of query rows over a paged KV cache (``kernels/paged_attention.cpp``, AVX-512).

The cache of one layer is a pool of blocks of ``BLOCK`` = 16 token positions:

    k_blocks [num_blocks, kv_heads, head_dim, 16]   keys, transposed inside a block (16 scores per register)
    v_blocks [num_blocks, kv_heads, 16, head_dim]   values

in fp32 or bf16 (half the bytes to stream; each value is widened exactly as it is loaded, the arithmetic is fp32)

and a request owns a list of blocks (its block table), so its memory follows its own length and a rollback is a
truncation of the table.  A forward hands the kernel every query row with its request (an index into the block
tables) and its absolute position; the row attends to positions 0..position of its request (or the last ``window``
of them).  Prefill chunks, verification blocks and decode rows of any number of requests go through the same call.

Batch invariance: each row is reduced over its keys in one fixed order, so its output does not depend on the other
rows of the call; with the batch-invariant linear (pipeline/ops/bf16_linear.py) a verification forward gives every
row exactly what a 1-token decode step would.  ``reference`` computes the same attention with torch (any CPU, any
device) to the usual float rounding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.ops.extensions import CppExtension

BLOCK = 16  # token positions per cache block
EXT = CppExtension("paged_attention", cpu_flags=("avx512f", "avx512bw", "avx512dq"),
                   cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mfma", "-fopenmp"],
                   disable_env="DSPARK_NO_PAGED_ATTENTION_KERNEL", what="the paged attention kernel")


def available() -> bool:
    return EXT.available()


def unavailable_reason() -> str | None:
    return EXT.unavailable_reason()


def paged_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor,
                    row_request: torch.Tensor, row_position: torch.Tensor, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """q [N, H, hd] fp32 -> [N, H, hd] fp32; see the module docstring for the other arguments (the blocks fp32 or
    bf16, tables int32 [R, W], row_request / row_position int64 [N])."""
    return EXT.module.paged_attention(q.contiguous(), k_blocks, v_blocks, tables, row_request, row_position,
                                      float(scale), int(window or 0))


def reference(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, tables: torch.Tensor,
              row_request: torch.Tensor, row_position: torch.Tensor, scale: float,
              window: int | None = None) -> torch.Tensor:
    """The same attention in torch, one SDPA per row (tests, and CPUs without the kernel)."""
    N, H, hd = q.shape
    KVH = k_blocks.shape[1]
    out = torch.empty_like(q)
    for i in range(N):
        p = int(row_position[i])
        blocks = tables[int(row_request[i]), :p // BLOCK + 1].long()
        k = k_blocks[blocks].float().permute(0, 3, 1, 2).reshape(-1, KVH, hd)[:p + 1]  # [p+1, KVH, hd]
        v = v_blocks[blocks].float().permute(0, 2, 1, 3).reshape(-1, KVH, hd)[:p + 1]
        if window:
            k, v = k[max(0, p + 1 - window):], v[max(0, p + 1 - window):]
        o = F.scaled_dot_product_attention(q[i][:, None], k.transpose(0, 1), v.transpose(0, 1), scale=scale,
                                           enable_gqa=H != KVH)
        out[i] = o[:, 0]
    return out


if __name__ == "__main__":  # scripts/setup.sh: build ahead of the first use
    ok = EXT.ensure(verbose=False)
    print(f"[setup] paged attention kernel: {'built' if ok else 'not used (' + str(unavailable_reason()) + ')'}")
