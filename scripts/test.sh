#!/usr/bin/env bash
# The test command (README): set-up (idempotent) + the whole test suite.  Extra args go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest -q --timeout=1200 "$@"
