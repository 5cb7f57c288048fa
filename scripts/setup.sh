#!/usr/bin/env bash
# Install colibri-plan into ./.venv with everything it needs.
#   scripts/setup.sh          # runtime: OpenCL + Vulkan backends, demo
#   scripts/setup.sh test     # + test dependencies (pytest, ruff, torch CPU, transformers, chromium)
# As root with apt it installs the Debian packages itself; otherwise it says what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-runtime}
PY=${PYTHON:-python3}

# vulkan-validationlayers: the Khronos layer the Vulkan synchronization-validation test runs under
debs=(pocl-opencl-icd ocl-icd-libopencl1 mesa-vulkan-drivers libvulkan1 vulkan-validationlayers glslang-tools fio)
# headless Chromium renders the `colibri-plan report` page in tests/test_report_page.py (tests only)
if [ "$mode" = test ]; then debs+=(chromium); fi
command -v "$PY" >/dev/null 2>&1 || debs+=(python3)
"$PY" -c 'import venv, ensurepip' >/dev/null 2>&1 || debs+=(python3-venv python3-pip)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian packages: ${missing[*]}" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "setup: missing Debian packages: ${missing[*]}" >&2
    echo "setup: without pocl-opencl-icd/ocl-icd-libopencl1 the OpenCL backend is unavailable;" \
         "without mesa-vulkan-drivers/libvulkan1 the Vulkan backend is; without vulkan-validationlayers" \
         "the Vulkan synchronization-validation test skips; without glslang-tools the" \
         "SPIR-V check is skipped; without fio bench/profile_vs_fio.py cannot run; without chromium" \
         "the report page's browser check is skipped. Under CI=true (or COLIBRI_REQUIRE_BACKENDS) the" \
         "tests fail instead of skipping a missing OpenCL/Vulkan backend or the validation layer." >&2
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip "setuptools>=68" wheel
if [ "$mode" = test ]; then
  # the CPU build of torch 2.13.0 (the oracle for the engine tests) before transformers asks for any torch
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[opencl,vulkan,test]"
else
  .venv/bin/python -m pip install -q -e ".[opencl,vulkan]"
fi
echo "setup: ok ($(.venv/bin/colibri-plan --version))" >&2
