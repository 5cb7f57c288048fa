"""llama.cpp's own tools for bench/replay_llamacpp.py: argument lists, and readers of what they print.

* ``llama-fit-params`` at a memory budget: on a CPU-only build ``--fit`` compares its projection with the
  host's *total* memory (sysconf, not a cgroup's limit), so the budget is given as the margin
  ``--fit-target = total - budget`` MiB; its answer is the CLI arguments it prints (or its refusal).
  ``--fit-print on`` prints its projection per device (model, context, compute MiB) for any placement.
* ``llama-bench -o json -r 1``: one process per measurement, so repeats of different placements can be
  interleaved; its JSON gives tok/s per test and the exact settings (threads, ubatch, types, sizes).
* ``llama-completion -lv 4``: the load log (``<buffer type> model/KV/compute buffer size = X MiB``) and the
  ``memory breakdown [MiB]`` table it prints at exit: llama.cpp's own accounting of a placement.

Placements are written once, in llama-bench's spelling and in the common one (completion, fit-params):
``-ot`` groups (``;`` in llama-bench, ``,`` in the common parser), ``--n-cpu-moe N``, ``--cpu-moe`` (the
override ``\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU`` of llama.cpp's common.h), ``--load-mode none``
(what ``--no-mmap`` is called in this llama.cpp).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

#: the tools the replay runs, in --llama-bin
TOOLS = ("llama-bench", "llama-fit-params", "llama-completion")
#: llama.cpp's --cpu-moe: every layer's routed-expert tensors in a plain CPU buffer (common.h)
CPU_MOE_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"
#: a per-projection split: the down projections in a plain CPU buffer, gate/up where llama.cpp puts them
DOWN_SPLIT_PATTERN = r"\.ffn_down_exps=CPU"
MiB = 1024 * 1024


def check_llama_bin(folder) -> str | None:
    """Why ``folder`` cannot run the replay (None when it can): a missing folder or tool."""
    d = Path(folder)
    if not d.is_dir():
        return f"--llama-bin {folder}: not a folder (build llama.cpp's tools there, docs/replay.md)"
    missing = [t for t in TOOLS if not (d / t).is_file()]
    if missing:
        return f"--llama-bin {folder}: no {', '.join(missing)} (build them: docs/replay.md)"
    return None


@dataclass
class Placement:
    """One llama.cpp placement: a name, what it means, and its arguments.

    ``overrides``: ``-ot`` patterns (``pattern=BUFFER``); ``n_cpu_moe``: ``--n-cpu-moe N``; ``cpu_moe``:
    ``--cpu-moe``; ``ngl``: ``-ngl`` (None: llama.cpp's default); ``load_mode``: ``--load-mode`` (None:
    the default, mmap); ``ctx``: the context fit chose (llama-bench has none: its context is prompt +
    generated tokens; recorded and passed to completion)."""
    name: str
    what: str
    overrides: list[str] = field(default_factory=list)
    n_cpu_moe: int | None = None
    cpu_moe: bool = False
    ngl: int | None = None
    load_mode: str | None = None
    repack: bool | None = None
    ctx: int | None = None
    ubatch: int | None = None  # -ub (None: llama.cpp's default 512)

    def bench_args(self) -> list[str]:
        """The arguments in llama-bench's spelling."""
        ot = ([CPU_MOE_PATTERN] if self.cpu_moe else []) + self.overrides
        out = ["-ot", ";".join(ot)] if ot else []
        out += ["-ncmoe", str(self.n_cpu_moe)] if self.n_cpu_moe is not None else []
        out += ["-ngl", str(self.ngl)] if self.ngl is not None else []
        out += ["--repack", "0"] if self.repack is False else []
        out += ["-ub", str(self.ubatch)] if self.ubatch is not None else []
        return out + (["-lm", self.load_mode] if self.load_mode else [])

    def common_args(self) -> list[str]:
        """The same in the common parser's spelling (llama-completion, llama-fit-params, llama-server)."""
        out = ["-ot", ",".join(self.overrides)] if self.overrides else []
        out += ["--cpu-moe"] if self.cpu_moe else []
        out += ["--n-cpu-moe", str(self.n_cpu_moe)] if self.n_cpu_moe is not None else []
        out += ["-ngl", str(self.ngl)] if self.ngl is not None else []
        out += ["--no-repack"] if self.repack is False else []
        out += ["-ub", str(self.ubatch)] if self.ubatch is not None else []
        return out + (["--load-mode", self.load_mode] if self.load_mode else [])

    def to_dict(self) -> dict:
        return {"name": self.name, "what": self.what, "overrides": self.overrides,
                "n_cpu_moe": self.n_cpu_moe, "cpu_moe": self.cpu_moe, "ngl": self.ngl,
                "load_mode": self.load_mode, "repack": self.repack, "fit_ctx": self.ctx,
                "ubatch": self.ubatch, "bench_args": self.bench_args(), "common_args": self.common_args()}


def standard_placements(n_layers: int, fit: Placement | None, export: Placement | None,
                        n_cpu_moe: int | None = None) -> list[Placement]:
    """The replay's placements: llama.cpp's defaults, fit's answer and our export (when given), then
    ``--cpu-moe``, ``--n-cpu-moe N`` (N = half the layers unless given), the down/gate-up split,
    ``--no-repack`` and ``--load-mode none``.

    On a CPU-only build an override to ``CPU`` still takes the CPU's extra buffer types (llama.cpp's
    model loader: "when overriding to a CPU buffer, consider the extra buffer types"), so the ``-ot``
    rows load the same buffers as the defaults; ``--no-repack`` and ``--load-mode none`` do not."""
    n = n_layers // 2 if n_cpu_moe is None else n_cpu_moe
    out = [Placement("default", "llama.cpp's defaults (mmap, repack where the CPU has a layout)")]
    out += [p for p in (fit, export) if p is not None]
    return out + [
        Placement("cpu-moe", "--cpu-moe: every layer's expert tensors in a plain CPU buffer", cpu_moe=True),
        Placement(f"n-cpu-moe-{n}", f"--n-cpu-moe {n}: the experts of the first {n} layers in a plain CPU "
                  "buffer", n_cpu_moe=n),
        Placement("down-split", "ffn_down_exps in a plain CPU buffer, gate/up at llama.cpp's default",
                  overrides=[DOWN_SPLIT_PATTERN]),
        Placement("no-repack", "--no-repack: no CPU-specific weight layout, every weight mmapped",
                  repack=False),
        Placement("no-mmap", "--load-mode none (this llama.cpp's --no-mmap): the weights read into RAM",
                  load_mode="none")]


def parse_fit_args(stdout: str) -> Placement:
    """llama-fit-params' printed CLI line (``-c N -ngl N [-ts ...] [-ot "a=B,c=D"]``) as a Placement.

    Raises:
        ValueError: no such line in ``stdout``.
    """
    line = next((ln.strip() for ln in reversed(stdout.splitlines()) if ln.strip().startswith("-c ")), None)
    if line is None:
        raise ValueError(f"llama-fit-params printed no '-c N -ngl N' line: {stdout[-300:]!r}")
    ctx = int(re.search(r"-c (\d+)", line).group(1))
    ngl = int(re.search(r"-ngl (-?\d+)", line).group(1))
    m = re.search(r'-ot "([^"]*)"', line)
    ot = [p for p in m.group(1).split(",") if p] if m else []
    return Placement("fit", f"llama-fit-params at the budget: {line}", overrides=ot,
                     ngl=None if ngl < 0 else ngl, ctx=ctx)


def parse_fit_print(stdout: str) -> list[dict]:
    """``--fit-print on`` rows: ``DEVICE model context compute`` (MiB) -> [{"device", ...}]."""
    rows = []
    for ln in stdout.splitlines():
        parts = ln.split()
        if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
            rows.append({"device": parts[0], "model_mib": int(parts[1]), "context_mib": int(parts[2]),
                         "compute_mib": int(parts[3])})
    return rows


_BUFFER = re.compile(r"(?:load_tensors|llama_kv_cache|llama_context|sched_reserve):\s+(\S+)\s+"
                     r"(model|KV|output|compute) buffer size =\s+([\d.]+) MiB")
_BREAKDOWN = re.compile(r"memory_breakdown_print: \|\s+- (.+?)\s+\|\s+(.*?)\|\s*$")
_PERF = re.compile(r"common_perf_print:\s+(load time|prompt eval time|eval time)\s+=\s+([\d.]+) ms"
                   r"(?: /\s+(\d+) (?:tokens|runs))?")


def parse_buffers(log: str) -> list[dict]:
    """Every ``<buffer type> <model|KV|output|compute> buffer size = X MiB`` line of a llama.cpp log."""
    return [{"buffer_type": m.group(1), "kind": m.group(2), "mib": float(m.group(3))}
            for m in _BUFFER.finditer(log)]


def parse_breakdown(log: str) -> dict:
    """The ``memory breakdown [MiB]`` tables of a llama-completion log: ``projected``, the one ``--fit``
    prints at start-up (before the weights load), and ``at_exit``, printed after the timings (None when
    the run died first). Rows: ``name`` and the numbers printed (devices: total, free, self, model,
    context, compute, unaccounted; Host and other buffer types: self = model + context + compute)."""
    out: dict = {"projected": None, "at_exit": None}
    cur, seen_perf = None, False
    for ln in log.splitlines():
        seen_perf = seen_perf or "common_perf_print" in ln
        if "memory_breakdown_print" not in ln:
            continue
        if "memory breakdown [MiB]" in ln:
            cur = []
            key = "at_exit" if seen_perf else "projected"
            if out[key] is None:
                out[key] = cur
            continue
        m = _BREAKDOWN.search(ln)
        if m and cur is not None:
            nums = [int(x) for x in re.findall(r"-?\d+", m.group(2))]
            keys = (("total", "free", "self", "model", "context", "compute", "unaccounted") if len(nums) == 7
                    else ("self", "model", "context", "compute"))
            cur.append({"name": m.group(1).strip(), **{f"{k}_mib": v for k, v in zip(keys, nums)}})
    return out


def parse_perf(log: str) -> dict:
    """llama-completion's timing lines: load / prompt eval / eval ms (and token counts)."""
    out = {}
    for m in _PERF.finditer(log):
        key = m.group(1).replace(" ", "_") + "_ms"
        out[key] = float(m.group(2))
        if m.group(3):
            out[key.replace("_ms", "_tokens")] = int(m.group(3))
    return out


#: llama-bench JSON fields kept per test (the settings the planner prices, and the measurement)
BENCH_KEYS = ("model_type", "model_size", "model_n_params", "n_batch", "n_ubatch", "n_threads", "type_k",
              "type_v", "n_gpu_layers", "n_cpu_moe", "tensor_buft_overrides", "load_mode", "lazy_mode",
              "repack", "flash_attn", "n_prompt", "n_gen", "n_depth", "avg_ts", "stddev_ts", "samples_ts",
              "samples_ns", "build_commit", "cpu_info", "backends")


def parse_bench(stdout: str) -> list[dict]:
    """llama-bench ``-o json`` output -> one dict per test (``pp``: n_prompt > 0, ``tg``: n_gen > 0) with
    :data:`BENCH_KEYS` and ``bytes_per_weight`` = model_size / model_n_params.

    Raises:
        ValueError: not llama-bench's JSON list.
    """
    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench printed no JSON ({e}): {stdout[-300:]!r}") from None
    if not isinstance(doc, list):
        raise ValueError("llama-bench JSON is not a list of tests")
    out = []
    for t in doc:
        row = {k: t.get(k) for k in BENCH_KEYS}
        row["test"] = "pp" if t.get("n_prompt", 0) and not t.get("n_gen", 0) else "tg"
        if t.get("model_n_params"):
            row["bytes_per_weight"] = t["model_size"] / t["model_n_params"]
        out.append(row)
    return out


def bench_argv(llama_bin: Path, gguf: Path, placement: Placement, threads: int, n_prompt: int, n_gen: int,
               ubatch: int) -> list[str]:
    """One llama-bench measurement (one repetition, JSON on stdout) of ``placement``."""
    return [str(llama_bin / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt),
            "-n", str(n_gen), *([] if placement.ubatch else ["-ub", str(ubatch)]), "-r", "1", "-o", "json",
            *placement.bench_args()]


def completion_argv(llama_bin: Path, gguf: Path, placement: Placement, threads: int, ctx: int,
                    ubatch: int, n_predict: int = 4) -> list[str]:
    """A short greedy llama-completion run of ``placement`` that logs its buffers and memory breakdown."""
    return [str(llama_bin / "llama-completion"), "-m", str(gguf), "-t", str(threads), "-c", str(ctx),
            *([] if placement.ubatch else ["-ub", str(ubatch)]), "-n", str(n_predict),
            "-p", "the quick brown fox", "-no-cnv", "--temp", "0", "-lv", "4", *placement.common_args()]


def fit_argv(llama_bin: Path, gguf: Path, threads: int, margin_mib: int) -> list[str]:
    """llama-fit-params asked to leave ``margin_mib`` of the host's total memory free."""
    return [str(llama_bin / "llama-fit-params"), "-m", str(gguf), "-t", str(threads),
            "-fitt", str(margin_mib)]


def fit_print_argv(llama_bin: Path, gguf: Path, placement: Placement, threads: int, ctx: int) -> list[str]:
    """llama-fit-params' projection of ``placement`` (MiB per device), no fitting."""
    return [str(llama_bin / "llama-fit-params"), "-m", str(gguf), "-t", str(threads), "-c", str(ctx),
            "-fitp", "on", *placement.common_args()]
