"""A machine profile built from stated figures instead of measurements (`colibri-plan profile synth`).

"One 24 GB GPU, 64 GB of RAM, a Gen4 NVMe, 16 cores" is enough to ask how fast a model will run before
owning the machine. :func:`synth_profile` turns such a statement (:class:`StatedMachine`, parsed from
flags or from one line by :func:`parse_machine`) into an ordinary profile document, so `solve` reads it
like a measured one. Every figure is labelled in the document's ``figures`` list and in its section's
``method``:

* ``stated`` — the user gave it (a card's memory, the RAM, the drive's kind or GB/s, the cores);
* ``default`` — a published figure for what was named or left out, with its source (vendor spec sheets
  for drive speeds, the PCI-SIG link rates, JEDEC DDR5 rates, NVIDIA's card spec);
* ``assumed`` — an estimate this tool makes (what share of a rated figure an engine reaches), with the
  measurement it leans on (the shipped ``profiles/h200-16core-gen5.json``, measured on an H200 host).

Nothing here is measured: `colibri-plan profile` on the machine itself replaces every figure. Sizes are
decimal (1 GB = 1e9 B, as everywhere in colibri-plan; write ``GiB`` for binary units).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from colibri_plan.errors import InputError
from colibri_plan.formats.profile import MachineProfile, machine_fingerprint
from colibri_plan.quant import FORMATS

#: rated sequential read GB/s per drive kind, and where the figure comes from
NVME_SEQ_GBPS = {
    "sata": (0.55, "SATA III's 6 Gb/s link: SATA SSDs are rated 530-560 MB/s sequential read (Samsung 870 "
                   "EVO: 560 MB/s, vendor spec)"),
    "gen3": (3.5, "PCIe 3.0 x4 NVMe drives are rated about 3.5 GB/s sequential read (Samsung 970 EVO Plus: "
                  "3,500 MB/s, vendor spec)"),
    "gen4": (7.0, "PCIe 4.0 x4 NVMe drives are rated 7.0-7.45 GB/s sequential read (Samsung 990 PRO: 7,450 "
                  "MB/s; WD_BLACK SN850X: 7,300 MB/s, vendor specs)"),
    "gen5": (14.0, "PCIe 5.0 x4 NVMe drives are rated 12.4-14.9 GB/s sequential read (Crucial T705: 14,500 "
                   "MB/s; Samsung 9100 PRO: 14,700 MB/s, vendor specs)"),
}
#: share of the rated sequential figure an expert-sized read reaches at each queue depth (an estimate)
NVME_DEPTH_SHARE = {1: 0.35, 2: 0.55, 4: 0.75, 8: 0.85, 16: 0.9}
NVME_DEPTH_SOURCE = ("rated figures are taken at deep queues; one ~10-20 MB read at a time gets "
                     "about a third (the shipped published-6x-rtx5090 profile takes 2.0 of 6.5 GB/s at depth "
                     "1, 6.0 at depth 8), rising to 90% at depth 16")
#: PCIe x16 raw GB/s per direction (PCI-SIG: 8 / 16 / 32 GT/s per lane, 128b/130b encoding, 16 lanes)
PCIE_X16_GBPS = {"gen3": 15.75, "gen4": 31.5, "gen5": 63.0}
#: what pinned and pageable copies reach of the raw rate: 53.7 and 14.4 GB/s of 63.0 on an H200 host
PCIE_PINNED_SHARE, PCIE_PAGEABLE_SHARE = 0.85, 0.23
PCIE_SOURCE = ("85% of the x16 link rate pinned, 23% pageable, as measured on an H200 host's "
               "PCIe 5.0 x16 (profiles/h200-16core-gen5.json: 53.7 and 14.4 GB/s of 63.0)")
#: a 24 GB card's memory bandwidth when none is stated, and the share an expert GEMV reads at
GPU_DEFAULT_GBPS = (1008.0, "an RTX 4090-class card: 1,008 GB/s of GDDR6X (NVIDIA spec)")
GPU_GEMV_SHARE = 0.5
#: RAM read bandwidth when none is stated: dual-channel DDR5-5600 (2 x 8 B x 5600 MT/s, JEDEC) at 70%
RAM_DEFAULT_GBPS = (round(2 * 8 * 5.6 * 0.7, 1), "dual-channel DDR5-5600: 89.6 GB/s peak (2 channels x 8 B "
                                                 "x 5,600 MT/s, JEDEC) at an assumed 70% for all-core reads")
CPU_GEMV_SHARE = 0.4
CPU_GEMV_SOURCE = ("40% of the RAM read rate, between the shipped measured profiles (27 of 82 GB/s "
                   "on an H200 host's 16 cores, 20 of 43 GB/s on a 2-core VM)")
#: time of a 16-row matmul over a 1-row one at the two expert shapes ([I, H], [H, I]), measured on an H200
#: host (profiles/h200-16core-gen5.json, int4): the prefill's batching gain
BATCH16_RATIO = {"cpu": (9.4, 9.2), "gpu": (4.3, 3.5)}
BATCH_SOURCE = "16-row / 1-row matmul time as measured on an H200 host (profiles/h200-16core-gen5.json)"
DEFAULT_CORES = 8
RAM_AVAILABLE_SHARE = 0.96
#: the matmul figures are given at GLM-5.2's expert shapes (the planner takes the nearest shape)
SHAPES = ((2048, 6144), (6144, 2048))
BLOCK_BYTES = 18_915_328

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")
_UNITS = {"": 1e9, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12, "m": 1e6, "mb": 1e6, "gib": 2**30,
          "tib": 2**40, "mib": 2**20}


def parse_size(text: str, flag: str) -> int:
    """'24G', '24GB', '24' (GB), '64GiB', '1.5T' -> bytes (decimal GB unless ``GiB``).

    Raises:
        InputError: not a positive size (the message names ``flag``).
    """
    m = _SIZE.fullmatch(str(text))
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise InputError(f"{flag} {text!r} is not a size; write e.g. 24G, 64GB or 64GiB (1 GB = 1e9 B)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _rate(text: str, flag: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v < 1e5:
        raise InputError(f"{flag}: {text!r} is not a rate in GB/s (a number such as 5.5)")
    return v


@dataclass(frozen=True)
class StatedMachine:
    """What a user stated about a machine; None / empty: not stated (a default is taken and named).

    Attributes:
        gpus: per discrete GPU, (memory bytes, memory bandwidth GB/s or None) [--gpu 24G[:GB/s][,...]].
        ram_bytes: the machine's RAM [--ram]. nvme: "sata", "gen3", "gen4", "gen5" or the rated sequential
            read in GB/s [--nvme]. cores: CPU cores [--cpu N]. ram_gbps: all-core RAM read GB/s
            [--cpu N:GB/s]. pcie: the GPUs' link, "gen3" / "gen4" / "gen5" [--pcie].
        line: the statement as the user wrote it (recorded in the profile).
    """

    ram_bytes: int
    gpus: tuple[tuple[int, float | None], ...] = ()
    nvme: str | float | None = None
    cores: int | None = None
    ram_gbps: float | None = None
    pcie: str | None = None
    line: str = field(default="", compare=False)

    @classmethod
    def from_flags(cls, *, ram: str | None = None, gpu: str | None = None, nvme: str | None = None,
                   cpu: str | None = None, pcie: str | None = None) -> StatedMachine:
        """Parse the ``profile synth`` flags (texts as typed; None: not given).

        Raises:
            InputError: a missing --ram, or a figure that does not parse (naming its flag).
        """
        gpus = []
        for item in (v.strip() for v in (gpu or "").split(",") if v.strip()):
            count = 1
            m = re.fullmatch(r"(\d+)\s*[xX]\s*(.+)", item)
            if m:
                count, item = int(m.group(1)), m.group(2)
                if count < 1:
                    raise InputError(f"--gpu {gpu!r}: {m.group(0)!r} states no GPU; give a count of 1 or "
                                     "more (2x24G), or leave --gpu out for a machine without one")
            size, _, bw = item.partition(":")
            gpus += [(parse_size(size, "--gpu"), _rate(bw, "--gpu ...:GB/s") if bw else None)] * count
        kind: str | float | None = None
        if nvme is not None:
            kind = nvme.strip().lower()
            if kind not in NVME_SEQ_GBPS:
                if not re.fullmatch(r"[0-9.]+", kind):
                    raise InputError(f"--nvme {nvme!r}: give sata, gen3, gen4, gen5 or the drive's rated "
                                     "sequential read in GB/s (e.g. 5.5)")
                kind = _rate(kind, "--nvme")
        cores = ram_gbps = None
        if cpu is not None:
            n, _, bw = str(cpu).partition(":")
            if not n.strip().isdigit() or int(n) < 1:
                raise InputError(f"--cpu {cpu!r}: give the cores, optionally with the RAM read GB/s (16 or "
                                 "16:80)")
            cores, ram_gbps = int(n), (_rate(bw, "--cpu N:GB/s") if bw else None)
        if pcie is not None and pcie.lower() not in PCIE_X16_GBPS:
            raise InputError(f"--pcie {pcie!r}: give one of {', '.join(PCIE_X16_GBPS)}")
        if ram is None:  # after the given figures, so a bad one is named before the missing one
            raise InputError("give the machine's RAM (--ram 64G, or ram=64G in a --machine line): it has no "
                             "default")
        line = " ".join(f"{k}={v}" for k, v in (("gpu", gpu), ("ram", ram), ("nvme", nvme), ("cpu", cpu),
                                                 ("pcie", pcie)) if v is not None)
        return cls(parse_size(ram, "--ram"), tuple(gpus), kind, cores, ram_gbps,
                   pcie.lower() if pcie else None, line)

    def summary(self) -> str:
        """One line: '1x 24 GB GPU, 64 GB RAM, NVMe gen4, 16 cores'."""
        gpus = {}
        for size, _ in self.gpus:
            gpus[size] = gpus.get(size, 0) + 1
        parts = [f"{n}x {size / 1e9:g} GB GPU" for size, n in gpus.items()] or ["no GPU"]
        drive = self.nvme or "gen4"
        parts += [f"{self.ram_bytes / 1e9:g} GB RAM",
                  f"NVMe {drive} GB/s" if isinstance(drive, float) else
                  ("SATA SSD" if drive == "sata" else f"NVMe {drive}"),
                  f"{self.cores or DEFAULT_CORES} cores"]
        return ", ".join(parts)


def parse_machine(text: str) -> StatedMachine:
    """A machine in one line, the ``profile synth`` flags as ``key=value`` words: ``gpu=24G ram=64G
    nvme=gen4 cpu=16`` (keys gpu, ram, nvme, cpu, pcie; separated by spaces or semicolons).

    Raises:
        InputError: an unknown key, a word without '=', or what :meth:`StatedMachine.from_flags` raises.
    """
    given: dict[str, str] = {}
    for word in (w for w in re.split(r"[\s;]+", text.strip()) if w):
        key, eq, value = word.partition("=")
        key = key.lower().lstrip("-")
        if not eq or key not in ("gpu", "ram", "nvme", "cpu", "pcie") or not value:
            raise InputError(f"--machine {text!r}: {word!r} is not key=value with a key among gpu, ram, "
                             "nvme, cpu, pcie; write e.g. 'gpu=24G ram=64G nvme=gen4 cpu=16'")
        if key in given:  # the last would win silently: two cards written as two gpu= words, say
            raise InputError(f"--machine {text!r}: {key}= is given twice ({given[key]!r} and {value!r}); "
                             "give it once (several GPUs: gpu=24G,16G or gpu=2x24G)")
        given[key] = value
    return StatedMachine.from_flags(**given)


def _fig(v: float) -> dict:
    return {"min": v, "median": v, "max": v, "repetitions": 1}


class _Figures:
    """The labelled figure list the profile carries (what, value, unit, origin, source)."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, what: str, value, unit: str, origin: str, source: str = "") -> str:
        self.rows.append({"what": what, "value": value, "unit": unit, "origin": origin, "source": source})
        return f"{origin}: {source}" if source else origin


def synth_profile(m: StatedMachine) -> MachineProfile:
    """The profile document of a stated machine (module docstring): machine, disk, RAM, devices, links
    and matmul sections like a measured profile's, plus ``figures`` (each figure with its origin and
    source) and ``stated`` (the statement).

    Raises:
        InputError: via :meth:`StatedMachine.from_flags` only; the document is valid by construction
            (FormatError otherwise, a bug).
    """
    figs = _Figures()
    cores = m.cores or DEFAULT_CORES
    figs.add("CPU cores", cores, "", "stated" if m.cores else "assumed",
             "" if m.cores else f"{DEFAULT_CORES} cores (not stated; they only size thread counts here)")
    figs.add("RAM", m.ram_bytes / 1e9, "GB", "stated")
    avail = int(m.ram_bytes * RAM_AVAILABLE_SHARE)
    figs.add("RAM available to programs", avail / 1e9, "GB", "assumed",
             f"{RAM_AVAILABLE_SHARE:.0%} of the RAM (the kernel, firmware and idle services hold the rest)")
    ram_gbps = m.ram_gbps or RAM_DEFAULT_GBPS[0]
    ram_method = figs.add("RAM read (all cores)", ram_gbps, "GB/s", "stated" if m.ram_gbps else "default",
                          "" if m.ram_gbps else RAM_DEFAULT_GBPS[1])
    cpu_gbps = CPU_GEMV_SHARE * ram_gbps
    cpu_method = figs.add("CPU expert GEMV (int4, 1 token)", round(cpu_gbps, 2), "GB/s", "assumed",
                          CPU_GEMV_SOURCE)
    drive = m.nvme if m.nvme is not None else "gen4"
    if isinstance(drive, float):
        seq, seq_method = drive, figs.add("drive sequential read (rated)", drive, "GB/s", "stated")
    else:
        seq = NVME_SEQ_GBPS[drive][0]
        figs.add("drive", drive, "", "stated" if m.nvme else "default",
                 "" if m.nvme else "a PCIe 4.0 NVMe drive (not stated)")
        seq_method = figs.add("drive sequential read (rated)", seq, "GB/s", "default",
                              NVME_SEQ_GBPS[drive][1])
    depth_method = figs.add("expert-block reads at queue depth 1 / 8", f"{seq * NVME_DEPTH_SHARE[1]:.2f} / "
                            f"{seq * NVME_DEPTH_SHARE[8]:.2f}", "GB/s", "assumed", NVME_DEPTH_SOURCE)
    random = [{"queue_depth": q, "read_gbps": _fig(seq * s),
               "latency_ms": {"p50": 1e3 * q * BLOCK_BYTES / (seq * s * 1e9),
                              "p99": 1.5e3 * q * BLOCK_BYTES / (seq * s * 1e9)}}
              for q, s in NVME_DEPTH_SHARE.items()]
    disk = {"path": "(stated, not measured)", "filesystem": "unknown", "o_direct": True,
            "page_cache_method": "stated figures (no page cache involved)", "block_bytes": BLOCK_BYTES,
            "random": random, "sequential": {"read_gbps": _fig(seq)},
            "method": f"sequential: {seq_method}; queue depths: {depth_method}"}
    devices = [{"backend": "cpu", "index": 0, "name": f"stated CPU ({cores} cores)", "kind": "cpu",
                "total_memory_bytes": m.ram_bytes, "free_memory_bytes": avail, "unified_memory": True,
                "formats": list(FORMATS), "driver": "n/a (stated)"}]
    matmul = [_matmul("cpu", 0, devices[0]["name"], "cpu", cpu_gbps, cpu_method)]
    links = []
    pcie = m.pcie or "gen4"
    if m.gpus:
        raw = PCIE_X16_GBPS[pcie]
        figs.add("GPU link", f"PCIe {pcie} x16", "", "stated" if m.pcie else "default",
                 f"{raw} GB/s per direction (PCI-SIG)" + ("" if m.pcie else "; PCIe 4.0 not stated"))
        link_method = figs.add("H2D pinned / pageable", f"{raw * PCIE_PINNED_SHARE:.1f} / "
                               f"{raw * PCIE_PAGEABLE_SHARE:.1f}", "GB/s", "assumed", PCIE_SOURCE)
    for i, (size, bw) in enumerate(m.gpus):
        name = f"stated {size / 1e9:g} GB GPU"
        figs.add(f"cuda:{i} memory", size / 1e9, "GB", "stated")
        bw_v = bw or GPU_DEFAULT_GBPS[0]
        figs.add(f"cuda:{i} memory bandwidth", bw_v, "GB/s", "stated" if bw else "default",
                 "" if bw else GPU_DEFAULT_GBPS[1])
        gemv = figs.add(f"cuda:{i} expert GEMV (int4, 1 token)", GPU_GEMV_SHARE * bw_v, "GB/s", "assumed",
                        f"{GPU_GEMV_SHARE:.0%} of the memory bandwidth (as the shipped published profile "
                        "assumes)")
        devices.append({"backend": "cuda", "index": i, "name": name, "kind": "gpu",
                        "total_memory_bytes": size, "free_memory_bytes": size, "unified_memory": False,
                        "formats": list(FORMATS), "driver": "n/a (stated)"})
        links.append({"backend": "cuda", "device_index": i, "device_name": name, "unified_memory": False,
                      "block_bytes": BLOCK_BYTES, "method": link_method,
                      **{f"{d}_{k}_gbps": _fig(raw * share) for d in ("h2d", "d2h")
                         for k, share in (("pinned", PCIE_PINNED_SHARE), ("pageable", PCIE_PAGEABLE_SHARE))}})
        matmul.append(_matmul("cuda", i, name, "gpu", GPU_GEMV_SHARE * bw_v, gemv))
    figs.add("16-row / 1-row matmul time (prefill batching)", "CPU 9.3x, GPU 3.9x", "", "assumed",
             BATCH_SOURCE)
    machine = {"cpu_model": f"stated: {cores} cores", "cores": cores, "logical_cpus": cores,
               "ram_total_bytes": m.ram_bytes, "ram_available_bytes": avail, "os": "(stated, not measured)",
               "python": "n/a"}
    machine["fingerprint"] = machine_fingerprint(machine, devices)
    doc = {"source": f"stated, not measured: {m.summary()} (colibri-plan profile synth {m.line})",
           "stated": {"line": m.line, "summary": m.summary()}, "figures": figs.rows, "machine": machine,
           "disk": disk, "ram": {"read_gbps": _fig(ram_gbps), "threads": cores, "method": ram_method},
           "devices": devices, "links": links if m.gpus else {"unavailable": "no GPU stated"},
           "matmul": [row for rows in matmul for row in rows]}
    return MachineProfile(doc)


def _matmul(backend: str, index: int, name: str, kind: str, gbps: float, method: str) -> list[dict]:
    """Matmul rows of one device at every quant format, both expert shapes, 1 and 16 tokens (16 rows
    take BATCH16_RATIO times one row's time: weight GB/s divided by it)."""
    ratios = BATCH16_RATIO["cpu" if kind == "cpu" else "gpu"]
    rows = []
    for fmt in FORMATS:
        for (out_f, in_f), ratio in zip(SHAPES, ratios):
            for tokens, g in ((1, gbps), (16, gbps / ratio)):
                s = out_f * in_f * 0.5 / (g * 1e9)   # int4 bytes of the shape at that rate
                rows.append({"backend": backend, "device_index": index, "device_name": name,
                             "device_kind": kind, "fmt": fmt, "out_features": out_f, "in_features": in_f,
                             "tokens": tokens, "weight_gbps": _fig(g), "seconds": _fig(s), "method": method})
    return rows
