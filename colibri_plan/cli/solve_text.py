"""What `colibri-plan solve` prints: the answer first (one line per engine a user may deploy, with its
predicted tok/s, time to first token and the command to paste, then where the plan went), the details
behind ``-v`` (budgets, trunk, placement, predicted terms, solver, knobs), then ``--compare`` and
``--what-if`` tables when asked for.
"""

from __future__ import annotations

from colibri_plan.cli.common import held_out_line, knob_lines, table

GB = 1e9
#: how the answer names each engine
ENGINE_NAMES = {"colibri-plan": "colibri-plan", "colibri": "colibrì", "llama.cpp": "llama.cpp"}


def _gb(x) -> str:
    return f"{x / GB:,.2f} GB"


def _secs(s) -> str:
    if s is None:
        return "-"
    return f"{s:.2f} s" if s < 10 else f"{s:.0f} s"


def answer_lines(result: dict, verbose: bool = False) -> list[str]:
    """The answer: a header naming the model and the machine, then per engine its predicted decode tok/s,
    time to first token and the command to paste (one line each, the command last and whole), the notes a
    paste needs (placeholders to replace), and where the plan is (or how to keep it)."""
    rows = result["engines"]
    pre = (result["predicted"].get("prefill") or {}).get("prompt_tokens")
    prompt = f" of a {pre}-token prompt" if pre else ""
    out = [f"{result['model']} on {result['profile']}",
           f"Predicted per engine: decode tok/s, time to first token{prompt}, and the command to paste:"]
    width = max(len(ENGINE_NAMES.get(r["engine"], r["engine"])) for r in rows)
    for r in rows:
        name = ENGINE_NAMES.get(r["engine"], r["engine"]).ljust(width)
        if r["command"] is None:
            out.append(f"  {name}  {'-'.ljust(12)} {'-'.ljust(7)} cannot run it: {r['why_not']}")
            continue
        tok = (f"{r['tok_s']:.3g} tok/s" if r["tok_s"] is not None else "-").ljust(12)
        out.append(f"  {name}  {tok} {_secs(r['ttft_s']).ljust(7)} {r['command']}")
    warn = held_out_line(result["predicted"], warn_only=True)
    if warn:
        out.append(f"  # {warn}")
    for r in rows:   # what a paste needs to work (the placeholders), and a figure that leaves the budget
        keep = ("replace", "first:", "beyond the plan's RAM budget")
        for n in r["notes"] if verbose else [n for n in r["notes"] if any(k in n for k in keep)]:
            out.append(f"  # {ENGINE_NAMES.get(r['engine'], r['engine'])}: {n}")
    if result["plan_written"]:
        extra = f" (and colibrì's usage file {result['usage_file']})" if result.get("usage_file") else ""
        out.append(f"Plan written to {result['plan_file']}{extra}")
    else:
        out.append(f"Plan not kept: pass --out plan.json to keep it (the commands above read "
                   f"{result['plan_file']} and {result['usage_path']}, which --out plan.json writes)")
    if not verbose:
        out.append("Details (budgets, trunk, placement, knobs): add -v, or `colibri-plan plan show PLAN`; "
                   "--compare prices the other engines' own placements")
    return out


def detail_lines(result: dict) -> list[str]:
    """The details of the solve: budgets, trunk options, placement, predicted terms, prefill, hit rates,
    solver and engine knobs."""
    from colibri_plan.planner.prefill import prefill_lines

    b = result["budgets"]
    out = ["Budgets:",
           table([[e["what"], _gb(e["bytes"])] for e in b["explain"]], None, right=(1,), indent=2)]
    out += trunk_lines(result["trunk"])
    c = dict(result["counts"])
    slots, per_layer = c.pop("lru_slots", 0), (result.get("knobs") or {}).get("cache_model") or {}
    names = {"ram_pinned": "pinned RAM", "disk": "disk (streamed)"}
    lru = f"; LRU slots {slots} in all" + (f" (per MoE layer: max {per_layer['lru_slots_max']})"
                                           if "lru_slots_max" in per_layer else "")
    out.append("Placement (experts): " + ", ".join(f"{names.get(k, k)} {v}" for k, v in c.items()) + lru)
    p = result["predicted"]
    t = p["terms"]
    out.append(f"Predicted: {p['tok_s']:.3f} tok/s ({p['decode_s_per_token'] * 1e3:.1f} ms/token): dense "
               f"{t['dense_s'] * 1e3:.1f} ms, attention {t['attention_s'] * 1e3:.1f} ms, expert layers "
               f"{t['expert_layers_s'] * 1e3:.1f} ms (disk wait {t['disk_wait_s'] * 1e3:.1f} ms, transfers "
               f"{t['transfer_s'] * 1e3:.1f} ms)")
    out += prefill_lines(p.get("prefill"))
    h = p["hit_rate"]
    out.append(f"Selections served from: VRAM {h['vram'] * 100:.1f}%, "
               f"pinned RAM {h['ram_pinned'] * 100:.1f}%, "
               f"LRU {h['lru'] * 100:.1f}%, disk {h['disk'] * 100:.1f}%; disk "
               f"{p['disk_bytes_per_token'] / 1e6:.1f} MB/token")
    ho = held_out_line(p)
    if ho:
        out.append(ho)
    s = result["solver"]
    gap = "n/a" if s["gap"] is None else f"{s['gap'] * 100:.3f}%"
    out.append(f"Solver: {s['method']}; {s['status']}; gap {gap}; {s['seconds']:.2f} s")
    out += knob_lines(result.get("knobs"), compute=result.get("compute"),
                      compute_explain=result.get("compute_explain"), repin=result.get("repin"))
    return out


def what_if_lines(w: dict) -> list[str]:
    """The `--what-if` table (and where the plot went)."""
    rows = [[f"{r['value']:.3g} {r['unit']}", f"{r['tok_s']:.3f}", f"{r['hot_first_tok_s']:.3f}",
             f"{r['vram'] * 100:.1f}", f"{r['ram_pinned'] * 100:.1f}", f"{r['disk'] * 100:.1f}"]
            for r in w["rows"]]
    out = [f"What-if {w['kind']}:", table(rows, [w["kind"], "tok/s (ours)", "tok/s (hot-first)", "VRAM %",
                                                 "pinned %", "disk %"])]
    return out + ([f"Plot written to {w['png']}"] if w.get("png") else [])


def trunk_lines(tr: dict) -> list[str]:
    """The VRAM trade of the trunk: each option's seconds, VRAM taken, VRAM left for experts, RAM for
    experts and predicted tok/s (options identical to another up to the device's name are folded; the
    devices given no VRAM are one line, not a paragraph each)."""
    chosen = next(r for r in tr["options"] if r["chosen"])
    how = "the least predicted decode time" if tr["mode"] == "auto" else f"--trunk {tr['mode']}"
    out = [f"Trunk (dense, attention, KV cache): on {tr['chosen']} ({how})"]
    empty = [r["option"] for r in tr["options"] if not r["feasible"] and r["option"] != "cpu"   # --vram 0
             and not any(r["vram_expert_budget_bytes"].get(k, 0) + v > 0
                         for k, v in r["vram_trunk_bytes"].items())]
    rows, same = [], {}
    for r in tr["options"]:
        if r["option"] in empty:
            continue
        if r["same_as"]:
            same.setdefault(r["same_as"], []).append(r["option"])
            continue
        taken = ", ".join(f"{k} {_gb(v)}" for k, v in r["vram_trunk_bytes"].items()) or "none"
        left = ", ".join(f"{k} {_gb(r['vram_expert_budget_bytes'][k])}"   # the CPU row: the chosen's devices
                         for k in r["vram_trunk_bytes"] or chosen["vram_trunk_bytes"]) or "all"
        tok = f"{r['tok_s']:.3f}" if r["tok_s"] is not None else ("not solved" if r["feasible"] else "no fit")
        rows.append([r["option"] + (" *" if r["chosen"] else ""), f"{r['dense_s'] * 1e3:.1f}",
                     f"{r['attention_s'] * 1e3:.1f}", f"{r['roundtrip_s'] * 1e3:.1f}", taken, left,
                     _gb(r["ram_budget_bytes"]), tok])
    out.append(table(rows, ["option", "dense ms", "attention ms", "(round trip ms)", "VRAM for trunk+KV",
                            "VRAM left for experts", "RAM for experts", "tok/s"], indent=2))
    out += [f"  {', '.join(v)}: as {k} (same figures and budget)" for k, v in same.items()]
    if empty:
        out.append(f"  {', '.join(empty)}: no VRAM given (--vram 0 there), not tried")
    out += [f"  {r['option']} does not fit: {r['why']}" for r in tr["options"]
            if not r["feasible"] and r["option"] not in empty]
    cpu = next((r for r in tr["options"] if r["option"] == "cpu"), None)
    if chosen["option"] != "cpu" and cpu is not None and cpu["tok_s"] is not None:
        n = sum(chosen["vram_trunk_bytes"].values())
        kv = f" + KV {_gb(chosen['kv_bytes'])}"
        out.append(f"  The trunk on {chosen['option']} takes {_gb(n)} of VRAM from experts (dense "
                   f"{_gb(chosen['dense_bytes'])}{kv}); predicted "
                   f"{chosen['tok_s']:.3f} tok/s against {cpu['tok_s']:.3f} with it on the CPU")
    return out


def _pct(x) -> str:
    return f"{x * 100:.1f}"


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _host_compute(compute: dict | None) -> str:
    """A compare row's host-tier processors, short: one name when they agree, else pinned/LRU/streamed."""
    if not compute:
        return "cpu"
    who = [compute.get(t, "cpu") for t in ("ram_pinned", "lru", "disk")]
    return who[0] if len(set(who)) == 1 else f"pin {who[0]}, LRU {who[1]}, miss {who[2]}"


def compare_tables(rows: list[dict]) -> list[str]:
    """`solve --compare` as three tables keyed by placement (one would be ~150 columns wide): what each
    placement predicts as its engine runs it, where its selections are served from, and the engine knobs
    it was priced with."""
    names = [r["placement"] for r in rows]
    pred = [[n, r["outcome"], "-", "-", "-", "-"] if r.get("outcome") else
            [n, f"{r['tok_s']:.3f}", f"{r['decode_s_per_token'] * 1e3:.1f}",
             f"{r['disk_bytes_per_token'] / 1e6:.1f}", _ratio(r.get("vs_best_baseline")),
             _ratio(r.get("vs_best_baseline_our_engine"))] for n, r in zip(names, rows)]
    served = [[n, _pct(h["vram"]), _pct(h["ram_pinned"]), _pct(h["lru"]), _pct(h["disk"]),
               _pct(r.get("knobs", {}).get("page_cache_hit_rate", 0.0))]
              for n, r, h in zip(names, rows, (r["hit_rate"] for r in rows))]
    knobs = []
    for n, r in zip(names, rows):
        k = r.get("knobs", {})
        uni = sum((k.get("unified_experts") or {}).values())
        pins = f"{k.get('pinned_experts', '?')}" + (f" +{uni} unified" if uni else "")
        knobs.append([n, r.get("engine", "?"), k.get("queue_depth", "?"),
                      "O_DIRECT" if k.get("o_direct", True) else "buffered", pins,
                      k.get("lru_slots_max", "?"), f"{k.get('host_copy_bytes', 0) / 1e9:.2f} GB",
                      _host_compute(k.get("compute"))])
    heads = ["placement", "engine", "queue depth", "reads", "pins", "LRU slots", "host copies",
             "host tiers on"]
    on_cpu = all(row[-1] == "cpu" for row in knobs)
    if on_cpu:   # the usual case: one sentence instead of a column of "cpu"
        knobs, heads = [row[:-1] for row in knobs], heads[:-1]
    return [
        "Predicted as each engine runs it (vs best (our engine): the placements alone, all on our engine):",
        table(pred, ["placement", "tok/s", "ms/token", "disk MB/tok", "vs best baseline",
                     "vs best (our engine)"]),
        "", "Selections served from (%; page cache: the part of disk reads the OS page cache serves):",
        table(served, ["placement", "VRAM %", "pinned %", "LRU %", "disk %", "page cache %"]),
        "", "Engine knobs each row is priced with:",
        table(knobs, heads),
    ] + (["Host tiers (pinned, LRU hits, streamed) are computed on the CPU in every row."] if on_cpu else [])
