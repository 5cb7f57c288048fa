"""Run a pack with a placement and measure it: the engine side of `run --plan` and `verify`.

:func:`run_placement` opens the devices a placement names (and the trunk's device, when the plan's
``trunk`` section puts the dense trunk, attention and the KV cache on one: checked to exist and to hold
trunk + KV + the VRAM experts before anything is uploaded), builds the
:class:`~colibri_plan.engine.residency.ResidencyManager` and the model (with a
:class:`~colibri_plan.engine.trunk.DeviceTrunk` on that device), decodes greedily and returns a
:class:`~colibri_plan.formats.report.RunReport` (the plan's ``predicted`` vocabulary): the tokens,
prefill and per-token decode time split into the terms the cost model predicts (dense/attention outside
the experts, expert compute per device, disk wait), hit rates per tier, disk bytes per token and peak
RSS. Statistics cover decode only (the prefill is reported apart: its time, and the residency manager's
figures of the prompt's forward pass in ``prefill_terms``), because the plan predicts decode.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Collection, Sequence

import numpy as np

from colibri_plan import meminfo
from colibri_plan.engine.forward import Model
from colibri_plan.engine.placement import Placement
from colibri_plan.engine.prompt_limits import NO_RAM_CHECK_ENV, check_positions, check_prefill_memory
from colibri_plan.engine.residency import ResidencyManager
from colibri_plan.errors import BackendUnavailableError, DeviceOutOfMemoryError, InputError, UnsupportedError
from colibri_plan.formats.plan_trunk import TrunkPlacement
from colibri_plan.formats.report import RunReport


def open_devices(placement: Placement, extra: Sequence[str] = ()) -> dict:
    """Open every backend device a placement names ("cuda:0" -> get_backend("cuda").open(0)), and the
    ``extra`` keys (the trunk's device), each once.

    Raises:
        InputError: a malformed device key. BackendUnavailableError: the backend cannot run here.
    """
    from colibri_plan.backends import get_backend

    devices = {}
    try:
        for key in sorted(set(placement.device_keys()) | set(extra)):
            name, _, idx = key.partition(":")
            if not idx.isdigit():
                raise InputError(f"device key {key!r} must look like '<backend>:<index>', e.g. 'cuda:0'")
            devices[key] = get_backend(name).open(int(idx))
    except BaseException:
        for b in devices.values():
            b.close()
        raise
    return devices


def _device_list() -> str:
    """Every device of every backend usable here, as "key (name)" (only on the refusal path: it may
    import GPU stacks)."""
    from colibri_plan.backends import BACKEND_NAMES, get_backend

    out = []
    for name in BACKEND_NAMES:
        cls = get_backend(name)
        if cls.is_available():
            out += [f"{name}:{d.index} ({d.name})" for d in cls.list_devices()]
    return ", ".join(out) or "none"


def check_trunk_device(key: str, asked_bytes: int) -> None:
    """Refuse, before opening anything, a trunk device this machine lacks.

    Raises:
        BackendUnavailableError: naming the device, the bytes the trunk asks and the devices that exist.
        UnsupportedError: an unknown backend name.
    """
    from colibri_plan.backends import get_backend

    name, _, idx = key.partition(":")
    if not idx.isdigit():
        raise InputError(f"trunk device {key!r} must look like '<backend>:<index>', e.g. 'cuda:0'")
    cls = get_backend(name)
    reason = cls.unavailable_reason() if not cls.is_available() else None
    n = 0 if reason else len(cls.list_devices())
    if int(idx) < n:
        return
    why = f"{name} is unavailable here: {reason}" if reason else f"{name} has {n} device(s) here"
    raise BackendUnavailableError(
        f"the dense trunk and KV cache are planned on {key} ({asked_bytes:,} B asked), but this machine "
        f"has no {key} ({why}); devices here: {_device_list()}; solve a plan with --trunk cpu or from "
        "this machine's profile")


def expert_bytes_on(pack, placement: Placement, key: str) -> int:
    """Bytes of the experts ``placement`` puts in VRAM on ``key`` (gate + up + down as uploaded)."""
    from colibri_plan.quant import tensor_bytes

    a = pack.arch
    one = 2 * tensor_bytes(pack.expert_format, a.moe_intermediate_size, a.hidden_size) \
        + tensor_bytes(pack.expert_format, a.hidden_size, a.moe_intermediate_size)
    return one * sum(len(placement.layer(layer).vram.get(key, [])) for layer in a.moe_layers)


def check_trunk_fits(backend, key: str, dense_bytes: int, kv_bytes: int, experts_bytes: int,
                     context_tokens: int) -> None:
    """Refuse a trunk whose dense + KV bytes, with the VRAM experts on its device, pass the device's
    ``capacity_bytes()`` (no-op when the device does not bound it), before any upload.

    Raises:
        DeviceOutOfMemoryError: the bytes asked (each part) and the bytes available.
    """
    cap = backend.capacity_bytes()
    need = int(dense_bytes) + int(kv_bytes) + int(experts_bytes)
    if cap is not None and need > cap:
        raise DeviceOutOfMemoryError(
            f"{key}: the dense trunk ({dense_bytes:,} B) + its KV cache for {context_tokens} tokens "
            f"({kv_bytes:,} B) + the plan's VRAM experts there ({experts_bytes:,} B) ask {need:,} B, but "
            f"the device has {cap:,} B available; solve with a smaller --vram or --context, or --trunk cpu",
            requested_bytes=need, held_bytes=backend.held_bytes, capacity_bytes=cap)


def check_trunk_plan(trunk: TrunkPlacement) -> None:
    """Refuse a trunk placement the engine cannot run: a split over several devices, or a KV cache away
    from the trunk (attention runs where the KV cache is, with the trunk).

    Raises:
        UnsupportedError: one line.
    """
    if trunk.split:
        devs = sorted({d for _, _, d in trunk.split})
        raise UnsupportedError(f"the plan splits the trunk over {', '.join(devs)}; the engine runs one trunk "
                               "device: solve with --trunk <device> (or --trunk cpu)")
    if trunk.kv_device != trunk.device:
        raise UnsupportedError(f"the plan puts the KV cache on {trunk.kv_device} and the trunk on "
                               f"{trunk.device}; the engine keeps them together: solve the plan again")


def mem_available_bytes() -> int | None:
    """MemAvailable in bytes, None where the OS does not say (the one reader: :mod:`colibri_plan.meminfo`)."""
    return meminfo.mem_available_bytes()


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


def prefill_terms(st) -> dict | None:
    """The RunReport's ``prefill_terms`` from the residency manager's statistics of the prefill (a
    :class:`~colibri_plan.engine.tierstats.TierStats`; None: not collected -> None). Totals over the
    prompt's forward pass (seconds, bytes), named as the decode terms and the plan's prefill terms."""
    if st is None:
        return None
    return {"experts_s": st.layer_wall_s,
            "expert_compute_s": {"cpu": st.cpu_compute_s, **st.device_compute_s},
            "disk_wait_s": st.disk_wait_s, "disk_read_s": st.disk_read_s, "disk_busy_s": st.disk_busy_s,
            "disk_bytes": st.disk_bytes, "hit_rate": st.hit_rates(),
            # host experts computed on the trunk's GPU (engine/offload.py): count, bytes up, upload seconds
            "offloaded_experts": st.offloaded, "offload_h2d_bytes": st.offload_h2d_bytes,
            "offload_h2d_s": st.offload_h2d_s}


class EngineSession:
    """A pack opened with a placement, ready to generate many times: the devices, the residency manager and
    the model are set up once (the checks of :func:`run_placement` first, before any upload).

    Args:
        pack, placement, cpu_backend, read_threads, verify_checksums, recorder, trunk: as
            :func:`run_placement`.
        context_tokens: tokens the trunk's cache reserves (a device trunk's bytes are checked against its
            device for at least this many); the plan's ``trunk.kv.context_tokens`` where it has one.

    Attributes:
        model (:class:`~colibri_plan.engine.forward.Model`), rm (the residency manager), key (the trunk's
        device key, None for the CPU trunk), load_s (seconds to load the experts' tiers).

    Raises:
        As :func:`run_placement`, at open.
    """

    def __init__(self, pack, placement: Placement, cpu_backend: str = "cpu", read_threads: int = 8,
                 verify_checksums: bool = True, recorder=None, trunk: TrunkPlacement | None = None,
                 context_tokens: int = 4096):
        from colibri_plan.backends import get_backend
        from colibri_plan.engine.trunk import trunk_dense_bytes, trunk_kv_bytes

        self.pack, self.placement = pack, placement
        trunk = trunk or getattr(placement, "trunk", None) or TrunkPlacement()
        check_trunk_plan(trunk)
        if trunk.context_tokens:   # the plan's --context: positions the model never trained for
            check_positions(pack.arch, trunk.context_tokens, f"the plan's context (solve --context "
                            f"{trunk.context_tokens})", "solve the plan again with a smaller --context")
        self.key = key = trunk.device if trunk.on_device else None
        self.context_tokens = int(context_tokens)
        reserve = 0
        if key is not None:
            reserve = trunk.context_tokens or min(self.context_tokens, 4096)  # the plan's, else the run's
            ctx = max(reserve, self.context_tokens)   # a run past the plan's context grows the cache
            dense_b, kv_b = trunk_dense_bytes(pack.arch, pack.dense, ctx), trunk_kv_bytes(pack.arch, ctx)
            check_trunk_device(key, dense_b + kv_b)
        if hasattr(pack, "expert_location"):   # in-memory weights hold their experts already
            check_ram_fits(pack, placement)  # before any device is opened or any expert allocated
        self.devices = open_devices(placement, () if key is None else (key,))
        self.cpu = self.rm = self.model = None
        try:
            if key is not None:
                check_trunk_fits(self.devices[key], key, dense_b, kv_b, expert_bytes_on(pack, placement, key),
                                 ctx)
            cpu_cls = get_backend(cpu_backend)
            self.cpu = cpu_cls.open(0) if cpu_cls.is_available() else get_backend("numpy").open(0)
            t_load = time.perf_counter()
            self.rm = ResidencyManager(pack, placement, self.cpu, devices=self.devices,
                                       read_threads=read_threads, verify_checksums=verify_checksums)
            self.load_s = time.perf_counter() - t_load
            self.model = Model(pack, experts=self.rm, recorder=recorder, trunk_backend=self.devices.get(key),
                               context_tokens=reserve)
        except BaseException:
            self.close()
            raise

    def generate(self, prompt_ids: Sequence[int], n_tokens: int,
                 progress: Callable[[str], None] | None = None,
                 sample: Callable[[np.ndarray], int] | None = None, stop_ids: Collection[int] = ()
                 ) -> RunReport:
        """Generate ``n_tokens`` >= 1 new ids greedily from ``prompt_ids`` in a fresh cache and measure the
        run (:func:`run_placement`'s report; statistics cover this call only). ``sample`` and ``stop_ids``
        as :meth:`Model.generate <colibri_plan.engine.forward.Model.generate>` (None: greedy).

        Raises:
            InputError: ``n_tokens`` < 1, bad prompt ids, or more positions than the model's
                ``max_position_embeddings``. BudgetError: a CPU trunk's prefill that MemAvailable cannot
                hold (engine/prompt_limits.py).
        """
        if int(n_tokens) < 1:
            raise InputError(f"--tokens must be >= 1, got {n_tokens}")
        n_ctx = len(prompt_ids) + int(n_tokens)   # before any allocation: engine/prompt_limits.py
        check_positions(self.pack.arch, n_ctx, f"the prompt ({len(prompt_ids):,} tokens) + --tokens "
                        f"{n_tokens}", "give a shorter prompt or fewer --tokens")
        if self.key is None:   # a CPU trunk's prefill lives in host memory (a device trunk's: checked there)
            check_prefill_memory(self.pack.arch, len(prompt_ids), n_ctx)
        model, rm = self.model, self.rm
        trunk = model.trunk
        rm.reset_stats()
        trunk.reset_stats()
        step_s: list[float] = []
        marks: dict = {"prefill": 0.0, "prefill_stats": None}

        def on_token(step: int, tok: int, seconds: float) -> None:
            if step == 0:
                marks["prefill"] = seconds
                marks["prefill_stats"] = rm.reset_stats()  # decode statistics start after the prefill
                trunk.reset_stats()
            else:
                step_s.append(seconds)
            if progress:
                progress(f"token {step + 1}/{n_tokens}: id {tok} ({seconds * 1e3:.0f} ms)")

        # step 0 is the prefill's token; steps 1..n_tokens-1 are the timed decode steps
        cache = model.new_cache(min(len(prompt_ids) + int(n_tokens), 4096))   # grows as it fills
        tokens = model.generate(list(prompt_ids), int(n_tokens), cache=cache, on_token=on_token,
                                sample=sample, stop_ids=stop_ids)
        return self._report(tokens, len(prompt_ids), step_s, marks, cache)

    def _report(self, tokens: list[int], n_prompt: int, step_s: list[float], marks: dict, cache) -> RunReport:
        rm, key, trunk = self.rm, self.key, self.model.trunk
        st = rm.stats
        n = max(1, len(step_s))
        decode_s = sum(step_s) / n
        attn = None   # timed by a device trunk (every step on a host backend, sampled on a GPU)
        if key is not None and trunk.attention_steps:
            attn = trunk.attention_s / trunk.attention_steps
        report = RunReport(
            tokens=tokens, prompt_tokens=n_prompt, decode_steps=len(step_s), load_s=self.load_s,
            prefill_s=marks["prefill"], decode_s_per_token=decode_s,
            decode_s_median=statistics.median(step_s) if step_s else 0.0,
            tok_s=1.0 / decode_s if decode_s > 0 else 0.0,
            dense_s_per_token=max(0.0, decode_s - st.layer_wall_s / n - (attn or 0.0)),
            attention_s_per_token=attn, trunk_device=key or "cpu",
            trunk_bytes=None if key is None else {"dense": trunk.dense_bytes,
                                                  "kv": int(cache.reserved_bytes)},
            expert_layers_s_per_token=st.layer_wall_s / n,
            expert_compute_s_per_token={"cpu": st.cpu_compute_s / n,
                                        **{k: v / n for k, v in st.device_compute_s.items()}},
            disk_wait_s_per_token=st.disk_wait_s / n, disk_read_s_per_token=st.disk_read_s / n,
            disk_busy_s_per_token=st.disk_busy_s / n,
            hit_rate=st.hit_rates(), lru_hit_rate=st.lru_hit_rate(),
            disk_bytes_per_token=st.disk_bytes / n,
            disk_read_gbps=st.disk_bytes / st.disk_busy_s / 1e9 if st.disk_busy_s > 0 else None,
            expert_uses_per_token=st.expert_uses / n,
            peak_rss_bytes=peak_rss_bytes(), resident_bytes=rm.resident_bytes(),
            o_direct=rm.o_direct, io_warning=rm.io_warning, placement=self.placement.summary(),
            page_cache_hit_rate=(st.page_cache_hits / st.uses["disk"] if st.uses["disk"] else 0.0)
            if self.placement.page_cache_experts is not None else None,
            prefill_terms=prefill_terms(marks["prefill_stats"]))
        if rm.repinner is not None:
            report.repins, report.repin_bytes, report.repin_s = st.repins, st.repin_bytes, st.repin_s
        return report

    def close(self) -> None:
        """Release the model's uploads, the residency manager and the backends. Safe to call twice."""
        if self.model is not None:
            self.model.close()   # the trunk's uploads; the backends close below
            self.model = None
        if self.rm is not None:
            self.rm.close()
            self.rm = None
        for b in self.devices.values():
            b.close()
        self.devices = {}
        if self.cpu is not None:
            self.cpu.close()
            self.cpu = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_placement(pack, placement: Placement, prompt_ids: Sequence[int], n_tokens: int,
                  cpu_backend: str = "cpu", read_threads: int = 8, verify_checksums: bool = True,
                  progress: Callable[[str], None] | None = None, recorder=None,
                  trunk: TrunkPlacement | None = None, sample: Callable[[np.ndarray], int] | None = None,
                  stop_ids: Collection[int] = ()) -> RunReport:
    """Generate ``n_tokens`` new ids greedily from ``prompt_ids`` with experts placed as ``placement`` says
    (one :class:`EngineSession`, opened and closed around one generation).

    The first new id comes from the prefill, so ``n_tokens - 1`` decode steps are timed (none for one
    token: the decode figures are then 0.0). A caller that wants N timed decode steps asks for N + 1.

    Args:
        pack: an open PackedModel, or weights held in memory (a checkpoint folder's ModelWeights) with
            every expert resident in the placement.
        cpu_backend: backend for CPU-resident and streamed experts and the CPU trunk ("cpu", else "numpy").
        progress: optional ``fn(message)`` called once per token.
        recorder: a RoutingRecorder to record routing into (prefill and decode), e.g. for --stats-out.
        trunk: where the dense trunk, attention and the KV cache run (the plan's ``trunk`` section,
            :func:`colibri_plan.formats.plan_trunk.parse_trunk`); None = ``placement.trunk``; None there
            or device "cpu" = the CPU trunk (on the ``cpu_backend``).
            On a device its KV cache reserves ``context_tokens`` (at least the run's prompt + tokens are
            checked to fit) and grows by whole pages past it.
        sample, stop_ids: as :meth:`EngineSession.generate` (None, (): greedy to ``n_tokens``).

    Raises:
        InputError: ``n_tokens`` < 1 or bad prompt ids. BudgetError: the placement's RAM exceeds
        MemAvailable (:func:`check_ram_fits`). UnsupportedError: a split trunk, or a KV cache away from the
        trunk. BackendUnavailableError: the trunk's device does not exist here (the devices that do are
        named). DeviceOutOfMemoryError: trunk + KV + VRAM experts pass the device's capacity. All before
        any upload. The ResidencyManager's errors (capacity, integrity).
    """
    if int(n_tokens) < 1:
        raise InputError(f"--tokens must be >= 1, got {n_tokens}")
    with EngineSession(pack, placement, cpu_backend=cpu_backend, read_threads=read_threads,
                       verify_checksums=verify_checksums, recorder=recorder, trunk=trunk,
                       context_tokens=len(prompt_ids) + int(n_tokens)) as session:
        return session.generate(prompt_ids, n_tokens, progress=progress, sample=sample, stop_ids=stop_ids)
