#!/usr/bin/env bash
# Install everything and run the main job on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cp=.venv/bin/colibri-plan
$cp backends
$cp model show glm-5.2
