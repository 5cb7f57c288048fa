"""Text lines of the llama.cpp pick and of what each ``--compare`` row was calibrated on (for the CLI)."""

from __future__ import annotations


def llama_lines(sec: dict) -> list[str]:
    """The plan's ``llamacpp`` section as a few lines: the verdict, why, the arguments, the memory."""
    c = sec["chosen"]
    mem = c["memory"]
    args = " ".join(f'"{a}"' if "\\" in a or "|" in a else a for a in c["args"])
    out = [f"llama.cpp ({sec['calibrated_on']}): {sec['verdict']}: {sec['why']}"]
    if sec["verdict"] == "use" or sec.get("fit") is None:
        out.append(f"  llama.cpp arguments: {args}")
    if sec.get("fit"):
        fit_args = " ".join(sec["fit"]["args"][:4])
        out.append(f"  --fit as priced: {fit_args} ... ({sec['fit']['decode_tok_s']:.1f} tok/s decode)")
    b = sec["budgets"]
    out.append(f"  llama.cpp's accounting: GPU {mem['gpu_total'] / 2**20:,.0f} MiB of "
               f"{b['vram_bytes'] / 2**20:,.0f}; host weights {mem['host_model'] / 2**20:,.0f} MiB "
               f"({'mapped' if '--no-mmap' not in c['args'] else 'read in'}) + buffers "
               f"{mem['anon_host'] / 2**20:,.0f} MiB within a {b['ram_limit_bytes'] / 1e9:.2f} GB limit")
    return out


def compare_notes(rows: list[dict], width: int = 100) -> list[str]:
    """What each row's prediction was calibrated on (by engine), and the notes of rows shown apart."""
    import textwrap

    on: dict[str, set] = {}
    for r in rows:
        engine = "llama.cpp" if str(r.get("engine", "")).startswith("llama.cpp") else "our cost model"
        on.setdefault(engine, set()).add(r.get("calibrated_on", "uncalibrated"))
    text = "Calibrated on: " + "; ".join(f"{k} rows: {', '.join(sorted(v))}" for k, v in on.items())
    out = textwrap.wrap(text, width, subsequent_indent="  ")
    for r in rows:
        if r.get("outside_budget"):
            out += textwrap.wrap(f"{r['placement']}: {r['note']}", width, subsequent_indent="  ")
    return out
