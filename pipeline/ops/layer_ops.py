"""The small operations between a decoder layer's matrix products, fused (``kernels/layer_ops.cpp``, AVX-512, fp32):

* ``rms_norm(x, w, eps)``: RMSNorm of [N, d] rows;
* ``add_rms_norm(x, y, w, eps)``: the residual add and the next RMSNorm in one pass -> (x + y, norm(x + y));
* ``rope_write_kv(qkv, cos, sin, k_blocks, v_blocks, blocks, offsets, num_heads)``: RoPE of q and k straight from
  the fused q/k/v projection, k and v written into their paged cache blocks (pipeline/ops/paged_attention.py's
  layout) -> q [N, H, hd].

Why: at a few rows per forward (decoding, verification) a layer's matrix products stream the weights once, and in
torch the glue between them is ~35 small operator calls per layer (norm statistics, the two halves of RoPE, two
cache scatters, views), each a few microseconds of dispatch: about a quarter of a 1-token forward of a 30-layer
target.  Fused, they are four calls.  Each row is computed alone in one fixed order, so the paged forward stays
batch-invariant (a row's output does not depend on the other rows of the call).  Where the CPU lacks AVX-512 or
a shape does not fit (``usable``), the target runner keeps the torch operations.
"""
from __future__ import annotations

import torch

from pipeline.ops.extensions import CppExtension

EXT = CppExtension("layer_ops", cpu_flags=("avx512f", "avx512dq"),
                   cflags=["-O3", "-mavx512f", "-mavx512dq", "-ffp-contract=off", "-fopenmp"],
                   disable_env="DSPARK_NO_LAYER_OPS_KERNEL", what="the fused layer operations kernel")


def available() -> bool:
    return EXT.available()


def unavailable_reason() -> str | None:
    return EXT.unavailable_reason()


def version() -> str:
    """Which kernel source this machine runs ("" where it does not: a cost profile taken with it does not apply)."""
    return EXT.build_paths()[0] if EXT.available() else ""


def usable(hidden_size: int, head_dim: int) -> bool:
    """The kernels take a model of these sizes (hidden size a multiple of 16, head dim of 32 up to 512) here."""
    return hidden_size % 16 == 0 and head_dim % 32 == 0 and head_dim <= 512 and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return EXT.module.rms_norm(x, weight, float(eps))


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    return EXT.module.add_rms_norm(x, y, weight, float(eps))


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_blocks: torch.Tensor,
                  v_blocks: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, num_heads: int) -> torch.Tensor:
    return EXT.module.rope_write_kv(qkv, cos, sin, k_blocks, v_blocks, blocks, offsets, int(num_heads))


if __name__ == "__main__":  # scripts/setup.sh: build ahead of the first use
    ok = EXT.ensure(verbose=False)
    print(f"[setup] fused layer operations kernel: {'built' if ok else 'not used (' + str(unavailable_reason()) + ')'}")
