#!/usr/bin/env bash
# Install test dependencies and run the whole test suite (lint, then pytest). Exit non-zero on any
# failure, including pytest's exit 5 (no tests collected).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# as root with apt, setup installed PoCL, lavapipe and the validation layer: a backend missing now is a
# failure, not a skip (tests/_require.py; CI sets CI=true, which requires the same)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export COLIBRI_REQUIRE_BACKENDS="${COLIBRI_REQUIRE_BACKENDS-numpy,cpu,opencl,vulkan}"
fi
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
