"""Per-selection costs the cost model and the solvers share: the CPU path's parts and linear rows, and
a GPU's seconds per expert computed (pure functions on plain numbers; formulas in
:mod:`colibri_plan.planner.costmodel`'s docstring).

Kept apart from :mod:`~colibri_plan.planner.costmodel` so the MILP (:mod:`.solve`), the aggregated solver
(:mod:`.aggregate`) and the cost model price a selection with one formula each.
"""

from __future__ import annotations

import numpy as np

from colibri_plan.formats.coefficients import Coefficients


def gpu_expert_seconds(gpu, expert_bytes: int, coef: Coefficients) -> float:
    """Seconds one selected expert on ``gpu`` (a :class:`~colibri_plan.planner.costmodel.GpuResource`)
    adds to its layer: c_gpu · b / matmul GB/s + ``gpu.expert_call_s``.

    ``expert_call_s`` is the host's cost of running one expert on the device that holds the trunk (the
    trunk hands those experts the device's own hidden state: the engine builds and uploads their launch
    table and launches them from the host each layer, Python included); 0 on other GPUs, whose layer
    call is the ``gpu_call_s`` + transfer term. It is outside c_gpu: a fixed cost, not a rate.
    E.g. b = 1e9 B at 100 GB/s, c_gpu 1, call 1e-5 s: 0.01001 s. Inside a replayed step
    (``step_expert_gbps`` > 0) the expert reads at that rate instead of the matmul figure.
    """
    gbps = gpu.step_expert_gbps if gpu.step_expert_gbps > 0 else gpu.matmul_gbps
    return coef.gpu_expert * expert_bytes / (gbps * 1e9) + float(gpu.expert_call_s)


def host_miss_seconds(cpu_s: tuple, call_s: float, disk_on_cpu: bool = True) -> tuple:
    """The per-tier seconds of one host expert (pinned, LRU hit, miss) with the CPU backend's per-call
    cost added to a streamed miss (each miss is its own call: costmodel's ``cpu_stream_l``), the form the
    solvers' linear rows take. The resident experts' one call per layer (1 − Π(1 − p)) is not linear in
    the placement and stays in the cost model's evaluation only. E.g. ((1, 2, 3), 0.5) -> (1, 2, 3.5)."""
    pin_s, lru_s, miss_s = cpu_s if isinstance(cpu_s, tuple) else (cpu_s, cpu_s, cpu_s)
    return pin_s, lru_s, miss_s + (float(call_s) if disk_on_cpu else 0.0)


def solver_host_seconds(res, expert_bytes: int, coef: Coefficients) -> tuple:
    """What the solvers charge per selection of a host tier (pinned, LRU hit, miss): the compute of
    :func:`~colibri_plan.planner.compute.host_seconds` with ``res.cpu_call_s`` per streamed miss when the
    CPU computes the misses (:func:`host_miss_seconds`)."""
    from colibri_plan.planner.compute import host_seconds

    on_cpu = dict(res.compute).get("disk", "cpu") == "cpu"
    return host_miss_seconds(host_seconds(res, expert_bytes, coef), res.cpu_call_s, on_cpu)


def solver_rates(res, expert_bytes: int, coef: Coefficients) -> tuple:
    """What the solvers charge per selection of a host tier, split by path: (host tiers' seconds (pinned,
    LRU hit, miss) as :func:`solver_host_seconds`, with pinned 0 when a discrete GPU computes it
    zero-copy; that GPU's index or None; its seconds per pinned expert, else 0). The solvers then put
    p · that seconds on the GPU's row instead of the CPU path's (costmodel's docstring). E.g. the
    pinned tier on cuda:0 at 50 GB/s, b = 1e9 B: ((0, lru, miss), 0, 0.02)."""
    from colibri_plan.planner.compute import mapped_gpu

    cpu_c = solver_host_seconds(res, expert_bytes, coef)
    zc = mapped_gpu(res)
    if zc is None:
        return cpu_c, None, 0.0
    return (0.0, cpu_c[1], cpu_c[2]), zc, float(cpu_c[0])


def cpu_path_parts(ram_p, lru_p, miss_p, cpu_s, disk_s: float, verify_s: float) -> tuple:
    """The CPU path's four parts from expected selections per token (floats or arrays alike).

    Args:
        ram_p: selections of pinned experts; lru_p: of disk-tier experts that hit the LRU; miss_p: of
            disk-tier experts read from disk. cpu_s: seconds to compute one expert (c_cpu included), or
            per host tier (pinned, LRU hit, miss) as :func:`~colibri_plan.planner.compute.host_seconds`
            gives when a unified GPU computes some of them (the path is then the host tiers' path, on
            their processors); disk_s: disk seconds per miss (c_disk included); verify_s: checksum
            seconds per miss.

    Returns:
        (resident_s, stream_s, disk_s, verify_s): compute of the pinned experts and LRU hits, compute
        of the misses, their reads, their crc32 checks.
    """
    pin_s, lru_s, miss_s = cpu_s if isinstance(cpu_s, tuple) else (cpu_s, cpu_s, cpu_s)
    return pin_s * ram_p + lru_s * lru_p, miss_s * miss_p, disk_s * miss_p, verify_s * miss_p


def cpu_path_seconds(resident_s, stream_s, disk_s, verify_s, overlap: float = 1.0):
    """The CPU path of a layer (costmodel's docstring): max(a, d) + (1 − overlap) · min(a, d) + stream_s
    with a = resident_s + verify_s, d = disk_s. Floats or numpy arrays (element-wise); the one formula the
    cost model, the solvers and calibrate use."""
    a = resident_s + verify_s
    return np.maximum(a, disk_s) + (1.0 - overlap) * np.minimum(a, disk_s) + stream_s


def cpu_path_bounds(resident_s, stream_s, disk_s, verify_s, overlap: float = 1.0) -> tuple:
    """The two linear forms whose max is :func:`cpu_path_seconds` (max(a, d) + k min(a, d) =
    max(a + k d, d + k a) for k = 1 − overlap in [0, 1]): (a + k d + stream, d + k a + stream)."""
    a, k = resident_s + verify_s, 1.0 - overlap
    return a + k * disk_s + stream_s, disk_s + k * a + stream_s


def cpu_path_rows(miss_factor, cpu_s, disk_s: float, verify_s: float, overlap: float = 1.0) -> tuple:
    """Coefficients of the solvers' two linear CPU-path rows, per unit of selection probability.

    The parts are linear in the selections, so each bound of :func:`cpu_path_bounds` is Σ p · coefficient:
    a pinned expert contributes ``ram[j]``, a disk-tier expert with miss factor f = 1 − h contributes
    ``disk[j]`` (f float or array).

    Returns:
        (ram, disk): each a pair (row 1, row 2) of coefficients (floats; arrays shaped like f for disk).
    """
    f = np.asarray(miss_factor, dtype=np.float64)
    ram = cpu_path_bounds(*cpu_path_parts(1.0, 0.0, 0.0, cpu_s, disk_s, verify_s), overlap)
    disk = cpu_path_bounds(*cpu_path_parts(0.0, 1.0 - f, f, cpu_s, disk_s, verify_s), overlap)
    return ram, disk
