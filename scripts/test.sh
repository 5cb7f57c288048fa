#!/usr/bin/env bash
# Install test dependencies and run the whole test suite (lint, then pytest). Exit non-zero on any
# failure, including pytest's exit 5 (no tests collected).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
