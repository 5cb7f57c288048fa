"""colibri-plan: measure a machine, plan where every MoE expert lives, run the plan and verify it."""

import os

# OpenBLAS's idle worker threads spin for 2^28 TSC cycles (~0.1 s) after every BLAS call before they
# sleep. The engine alternates numpy BLAS (dense trunk) with the cpu backend's numba kernels (experts)
# every layer, so the spinning workers took the cores from numba's threads (docs/engine.md, "Threads on
# many-core hosts").
# 2^4 cycles: sleep at once (on a 16-core H200 host it beat 2^16 by ~10% per decode token, and 2^28 by
# 4.6x; bench/results/h200-engine-threads.json). OpenBLAS reads
# this when it loads, i.e. at the first `import numpy`: set here, before any module imports numpy; a
# process that imported numpy before colibri_plan keeps OpenBLAS's default (no runtime setter exists).
# A value the user exported wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

__version__ = "0.1.0"
