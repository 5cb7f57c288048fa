#!/usr/bin/env bash
# Rebuild every shaders/vulkan/*.spv from its .comp with glslang (Debian: apt-get install glslang-tools).
# The .spv files are committed; tests/test_vulkan_spirv.py checks they match a fresh compile of this kind.
set -euo pipefail
cd "$(dirname "$0")/../shaders/vulkan"
command -v glslangValidator >/dev/null || { echo "glslangValidator not found: apt-get install glslang-tools" >&2; exit 1; }
for src in *.comp; do
    glslangValidator -V --target-env vulkan1.1 --quiet "$src" -o "${src%.comp}.spv"
    echo "compiled shaders/vulkan/${src%.comp}.spv" >&2
done
