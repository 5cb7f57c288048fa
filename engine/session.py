"""Run a pack with a placement and measure it: the engine side of `run --plan` and `verify`.

:func:`run_placement` opens the devices a placement names, builds the
:class:`~colibri_plan.engine.residency.ResidencyManager`, decodes greedily and returns a
:class:`RunReport`: the tokens, prefill and per-token decode time split into the terms the cost model
predicts (dense/attention outside the experts, expert compute per device, disk wait), hit rates per
tier, disk bytes per token and peak RSS. Statistics cover decode only (the prefill is reported apart),
because the plan predicts decode.
"""

from __future__ import annotations

import resource
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from colibri_plan.engine.forward import Model
from colibri_plan.engine.placement import Placement
from colibri_plan.engine.residency import ResidencyManager
from colibri_plan.errors import InputError


@dataclass
class RunReport:
    """What one measured run did (seconds, bytes; per-token figures are decode means).

    Attributes:
        tokens: generated ids (prompt excluded).
        prefill_s: wall time of the prompt's forward pass.
        decode_s_per_token: mean wall time of a decode step; ``decode_s_median`` its median.
        tok_s: 1 / decode_s_per_token.
        terms: per-token decode split: ``dense_s`` (attention, router, shared/dense FFN, LM head: all
            outside the expert provider), ``expert_cpu_s``, ``device_s`` {key: s}, ``disk_wait_s``,
            ``disk_read_s`` (reader-thread time, overlapped), ``expert_wall_s``.
        hit_rates: share of expert computations per tier (vram, pinned, lru, disk); ``lru_hit_rate``.
        disk_bytes_per_token, disk_read_gbps (disk bytes / time the reads of a wave were in flight, i.e.
        the throughput streaming achieved), peak_rss_bytes, resident_bytes {tier: bytes}, o_direct,
        io_warning. ``decode_steps``: the decode steps the means are over (tokens - 1).
    """

    tokens: list[int]
    prefill_s: float
    decode_s_per_token: float
    decode_s_median: float
    tok_s: float
    terms: dict
    hit_rates: dict
    lru_hit_rate: float
    disk_bytes_per_token: float
    disk_read_gbps: float | None
    expert_uses_per_token: float
    peak_rss_bytes: int
    resident_bytes: dict
    o_direct: bool
    io_warning: str | None
    placement: dict = field(default_factory=dict)
    decode_steps: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def open_devices(placement: Placement) -> dict:
    """Open every backend device a placement names ("cuda:0" -> get_backend("cuda").open(0)).

    Raises:
        InputError: a malformed device key. BackendUnavailableError: the backend cannot run here.
    """
    from colibri_plan.backends import get_backend

    devices = {}
    try:
        for key in placement.device_keys():
            name, _, idx = key.partition(":")
            if not idx.isdigit():
                raise InputError(f"device key {key!r} must look like '<backend>:<index>', e.g. 'cuda:0'")
            devices[key] = get_backend(name).open(int(idx))
    except BaseException:
        for b in devices.values():
            b.close()
        raise
    return devices


#: set to 1 to skip the check that a placement's RAM fits this machine's available memory
NO_RAM_CHECK_ENV = "COLIBRI_PLAN_NO_RAM_CHECK"


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, bytes (None where there is no /proc/meminfo)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def placement_ram_bytes(pack, placement: Placement) -> int:
    """RAM the residency manager allocates up front for ``placement``: one expert block per pinned expert,
    per LRU slot and per working buffer (top-k in-flight misses). The pack's dense tensors are already
    loaded when it is open, so they are not counted."""
    arch = pack.arch
    block = max(pack.expert_location(layer, 0)[1] for layer in arch.moe_layers)
    n = arch.top_k + sum(len(placement.layer(layer).ram_pinned) + placement.layer(layer).lru_slots
                         for layer in arch.moe_layers)
    return n * block


def check_ram_fits(pack, placement: Placement, available: int | None = None) -> None:
    """Refuse a placement whose up-front RAM (:func:`placement_ram_bytes`) exceeds MemAvailable, before
    anything is allocated (the pinned experts are read and pre-faulted at start-up). Skipped when
    ``$COLIBRI_PLAN_NO_RAM_CHECK`` is 1 or the available memory is unknown.

    Raises:
        BudgetError: naming the bytes needed and available and how to proceed.
    """
    import os

    from colibri_plan.errors import BudgetError

    if os.environ.get(NO_RAM_CHECK_ENV) == "1":
        return
    available = mem_available_bytes() if available is None else available
    need = placement_ram_bytes(pack, placement)
    if available is not None and need > available:
        raise BudgetError(f"the placement needs {need / 1e9:.2f} GB of RAM up front (pinned experts, LRU "
                          f"slots and working buffers: {need:,} B) but this machine has "
                          f"{available / 1e9:.2f} GB available ({available:,} B, MemAvailable); solve a plan "
                          f"with a smaller --ram, or "
                          f"set {NO_RAM_CHECK_ENV}=1 to run it anyway")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def run_placement(pack, placement: Placement, prompt_ids: Sequence[int], n_tokens: int,
                  cpu_backend: str = "cpu", read_threads: int = 8, verify_checksums: bool = True,
                  progress: Callable[[str], None] | None = None, recorder=None) -> RunReport:
    """Generate ``n_tokens`` new ids greedily from ``prompt_ids`` with experts placed as ``placement`` says.

    The first new id comes from the prefill, so ``n_tokens - 1`` decode steps are timed (none for one
    token: the decode figures are then 0.0). A caller that wants N timed decode steps asks for N + 1.

    Args:
        pack: an open PackedModel.
        cpu_backend: backend for CPU-resident and streamed experts ("cpu", else "numpy").
        progress: optional ``fn(message)`` called once per token.
        recorder: a RoutingRecorder to record routing into (prefill and decode), e.g. for --stats-out.

    Raises:
        InputError: ``n_tokens`` < 1 or bad prompt ids. BudgetError: the placement's RAM exceeds
        MemAvailable (:func:`check_ram_fits`). The ResidencyManager's errors (capacity, integrity).
    """
    from colibri_plan.backends import get_backend

    if int(n_tokens) < 1:
        raise InputError(f"--tokens must be >= 1, got {n_tokens}")
    check_ram_fits(pack, placement)  # before any device is opened or any expert allocated
    devices = open_devices(placement)
    cpu = None
    rm = None
    try:
        cpu_cls = get_backend(cpu_backend)
        cpu = cpu_cls.open(0) if cpu_cls.is_available() else get_backend("numpy").open(0)
        rm = ResidencyManager(pack, placement, cpu, devices=devices, read_threads=read_threads,
                              verify_checksums=verify_checksums)
        model = Model(pack, experts=rm, recorder=recorder)
        step_s: list[float] = []
        marks = {"prefill": 0.0}

        def on_token(step: int, tok: int, seconds: float) -> None:
            if step == 0:
                marks["prefill"] = seconds
                rm.reset_stats()  # decode statistics start after the prefill
            else:
                step_s.append(seconds)
            if progress:
                progress(f"token {step + 1}/{n_tokens}: id {tok} ({seconds * 1e3:.0f} ms)")

        # step 0 is the prefill's token; steps 1..n_tokens-1 are the timed decode steps
        tokens = model.generate(list(prompt_ids), int(n_tokens), on_token=on_token)
        st = rm.stats
        n = max(1, len(step_s))
        decode_s = sum(step_s) / n
        report = RunReport(
            tokens=tokens, prefill_s=marks["prefill"], decode_s_per_token=decode_s,
            decode_s_median=statistics.median(step_s) if step_s else 0.0,
            tok_s=1.0 / decode_s if decode_s > 0 else 0.0,
            terms={"dense_s": max(0.0, decode_s - st.layer_wall_s / n),
                   "expert_wall_s": st.layer_wall_s / n,
                   "expert_cpu_s": st.cpu_compute_s / n,
                   "device_s": {k: v / n for k, v in st.device_compute_s.items()},
                   "disk_wait_s": st.disk_wait_s / n,
                   "disk_read_s": st.disk_read_s / n,
                   "disk_busy_s": st.disk_busy_s / n},
            hit_rates=st.hit_rates(), lru_hit_rate=st.lru_hit_rate(),
            disk_bytes_per_token=st.disk_bytes / n,
            disk_read_gbps=st.disk_bytes / st.disk_busy_s / 1e9 if st.disk_busy_s > 0 else None,
            expert_uses_per_token=st.expert_uses / n,
            peak_rss_bytes=peak_rss_bytes(), resident_bytes=rm.resident_bytes(),
            o_direct=rm.o_direct, io_warning=rm.io_warning, placement=placement.summary(),
            decode_steps=len(step_s))
        return report
    finally:
        if rm is not None:
            rm.close()
        for b in devices.values():
            b.close()
        if cpu is not None:
            cpu.close()

