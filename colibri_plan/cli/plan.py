"""`colibri-plan plan show`: inspect a plan file."""

from __future__ import annotations

import click

from colibri_plan.cli.common import emit, held_out_line, json_option, knob_lines, table


@click.group("plan")
def plan():
    """Inspect plan files."""


@plan.command("show")
@click.argument("path")
@click.option("--layers", "show_layers", is_flag=True, help="One line per MoE layer.")
@click.option("--budgets", "show_budgets", is_flag=True,
              help="How the RAM and VRAM budgets were reached, a line per step (as solve -v prints).")
@json_option
def show(path, show_layers, show_budgets):
    """Print a plan: model, machine, budgets, tier sizes, predicted tok/s and its terms, solver facts, the
    engine knobs it was solved for."""
    from colibri_plan.formats.plan import load_plan

    p = load_plan(path)
    d = p.doc
    data = {"file": path, "model": d["model"]["name"], "model_fingerprint": p.model_fingerprint,
            "profile": d["profile"], "heat": d["heat"], "budgets": d["budgets"], "counts": p.counts(),
            "predicted": d["predicted"], "solver": d["solver"], "expert_format": d["expert_format"],
            "knobs": d.get("knobs"), "compute": d.get("compute"), "compute_explain": d.get("compute_explain"),
            "repin": d.get("repin"), "trunk": d.get("trunk"), "predicted_trunk": d["predicted"].get("trunk")}
    mtp = d["model"].get("mtp_expert_bytes")
    if mtp:
        data["mtp_expert_bytes"] = mtp
    if show_layers:
        data["layers"] = [{"layer": e["layer"], **{k: len(v) for k, v in e["vram"].items()},
                           "ram_pinned": len(e["ram_pinned"]), "lru_slots": e["lru_slots"],
                           "disk": len(e["disk"])} for e in d["layers"]]

    sv = d["solver"]

    def human():
        pr, t, h = d["predicted"], d["predicted"]["terms"], d["predicted"]["hit_rate"]
        lines = [f"plan {path}: {data['model']} ({d['expert_format']}, fingerprint {p.model_fingerprint})",
                 f"machine: {d['profile'].get('cpu_model')}, GPUs {d['profile'].get('gpus')} "
                 f"(profile {d['profile'].get('fingerprint')})",
                 f"heat: {d['heat'].get('source', '(not recorded)')}",
                 f"RAM budget for experts {d['budgets']['ram_budget_bytes'] / 1e9:.2f} GB; VRAM "
                 + (", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in d["budgets"]["vram_budget_bytes"].items())
                    or "none (no GPU in the profile)"),
                 "experts: " + ", ".join(f"{k} {v}" for k, v in data["counts"].items()),
                 f"predicted {pr['tok_s']:.3f} tok/s = {pr['decode_s_per_token'] * 1e3:.1f} ms/token "
                 f"(dense {t['dense_s'] * 1e3:.1f}, attention {t['attention_s'] * 1e3:.1f}, expert layers "
                 f"{t['expert_layers_s'] * 1e3:.1f}, of which disk wait {t['disk_wait_s'] * 1e3:.1f} ms)",
                 f"served from VRAM {h['vram'] * 100:.1f}%, pinned {h['ram_pinned'] * 100:.1f}%, LRU "
                 f"{h['lru'] * 100:.1f}%, disk {h['disk'] * 100:.1f}%; "
                 f"{pr['disk_bytes_per_token'] / 1e6:.1f} MB/token from disk",
                 f"solver: {sv.get('method', '?')}, {sv.get('status', '?')}, "
                 + (f"{sv['seconds']} s" if "seconds" in sv else "time not recorded"),
                 "cost coefficients: " + (", ".join(f"{k} {v:g}" for k, v in d["coefficients"].items())
                                          if d.get("coefficients") else "defaults (not calibrated)")]
        ho = held_out_line(pr)
        if ho:
            lines.insert(7, ho)   # after the served-from line
        lines.insert(5, trunk_line(d))
        from colibri_plan.planner.prefill import prefill_lines

        lines[7:7] = prefill_lines(pr.get("prefill"))   # after the predicted decode line
        if mtp:
            lines.insert(5, f"MTP experts: {mtp / 1e6:.2f} MB each (colibrì's int8)")
        lines += knob_lines(d.get("knobs"), compute=d.get("compute"),
                            compute_explain=d.get("compute_explain"), repin=d.get("repin"))
        explain = d["budgets"].get("explain")
        if show_budgets and explain:
            lines += ["Budgets:", table([[e["what"], f"{e['bytes'] / 1e9:.2f} GB"] for e in explain], None,
                                        right=(1,), indent=2)]
        elif show_budgets:
            lines.append("Budgets: the plan records no steps (a plan from before they were kept)")
        if show_layers:
            keys = p.device_keys
            rows = [[e["layer"]] + [len(e["vram"].get(k, [])) for k in keys]
                    + [len(e["ram_pinned"]), e["lru_slots"], len(e["disk"])] for e in d["layers"]]
            lines.append(table(rows, ["layer"] + keys + ["pinned", "LRU slots", "disk"]))
        return "\n".join(lines)

    emit(data, human)


def trunk_line(d: dict) -> str:
    """Where the plan runs the dense trunk, attention and KV cache, their bytes and predicted seconds."""
    t, pt = d.get("trunk"), d["predicted"].get("trunk")
    if t is None:
        return "trunk: on the CPU (the plan has no trunk section: it predates trunk placement)"
    kv = t["kv"]
    where = t["device"] if not t.get("split") else "split " + ", ".join(
        f"{s['device']} layers {s['first_layer']}-{s['last_layer']}" for s in t["split"])
    line = (f"trunk: on {where} ({t.get('dense_format') or '?'}, dense {t['dense_bytes'] / 1e9:.2f} GB + KV "
            f"{kv['bytes'] / 1e9:.2f} GB for {kv['context_tokens']} tokens)")
    if pt:
        line += (f": dense {pt['dense_s_per_token'] * 1e3:.1f} ms (host round trips "
                 f"{pt['host_roundtrip_s_per_token'] * 1e3:.1f}), attention "
                 f"{pt['attention_s_per_token'] * 1e3:.1f} ms per token")
    return line
