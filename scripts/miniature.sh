#!/usr/bin/env bash
# The main command (README): set-up (idempotent) + the local miniature run.  Extra args go to jobs.miniature.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/python -m jobs.miniature "$@"
