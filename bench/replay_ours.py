"""Our side of bench/replay_llamacpp.py, through the ``colibri-plan`` command line as a user runs it:
a profile of this machine at the pack's expert shape, routing heat from an all-RAM run, ``solve --ram``
(with ``--compare``), the llama.cpp export's ``-ot`` patterns, colibrì's hot-first fill written as a plan
(bench/baseline_plan.py) and ``verify`` runs (in or out of the memory cgroup). Every call returns the
command's ``--json`` document. Results are cached in the work folder by file name.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def default_cli() -> str:
    """The ``colibri-plan`` beside this interpreter (the venv the script runs in)."""
    return str(Path(sys.executable).with_name("colibri-plan"))


def cli_json(colibri: str, *args, env: dict | None = None) -> dict:
    """``colibri-plan ARGS --json`` -> its document.

    Raises:
        RuntimeError: the command failed (its last stderr lines in the message).
    """
    r = subprocess.run([colibri, *map(str, args), "--json"], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"colibri-plan {' '.join(map(str, args[:2]))} failed ({r.returncode}): "
                           f"{r.stderr.strip()[-600:]}")
    return json.loads(r.stdout)


def prompt_ids(n: int, seed: int = 1, vocab_hi: int = 500) -> list[int]:
    """``n`` seeded prompt token ids in [2, vocab_hi) (bench/peer_llamacpp.py's prompts)."""
    rnd = random.Random(seed)
    return [rnd.randrange(2, vocab_hi) for _ in range(n)]


def profile(colibri: str, pack: Path, formats: str, work: Path, given: str | None = None,
            quick: bool = False) -> str:
    """A profile of this machine (cpu backend, ``formats``, disk probed in ``work``) at the pack's expert
    shape (``--quick``: fewer repetitions, queue depths 1 and 4); ``given`` is used as it is."""
    if given:
        return given
    out = work / f"profile{'-quick' if quick else ''}-{formats.replace(',', '-')}.json"
    if not out.exists():
        cli_json(colibri, "profile", "--model", pack, "--backends", "cpu", "--formats", formats,
                 *(["--quick"] if quick else []), "--path", work, "--out", out)
    return str(out)


def heat(colibri: str, pack: Path, work: Path, n_prompt: int = 256, n_tokens: int = 8,
         vocab_hi: int = 500, seed: int = 7) -> Path:
    """Routing heat of an all-RAM run (``run --stats-out``) on an ``n_prompt``-token prompt of ids below
    ``vocab_hi`` drawn with ``seed``."""
    out = work / f"heat-{Path(pack).name}{'' if seed == 7 else f'-seed{seed}'}.json"
    if not out.exists():
        ids = ",".join(map(str, prompt_ids(n_prompt, seed=seed, vocab_hi=vocab_hi)))
        cli_json(colibri, "run", "--model", pack, "--backend", "cpu", "--prompt-ids", ids, "--tokens",
                 n_tokens, "--stats-out", out)
    return out


def solve(colibri: str, prof: str, pack: Path, heat_path: Path, ram_gb: float, context: int,
          out: Path, prompt_tokens: int) -> dict:
    """``solve --ram ram_gb --compare`` for this pack; writes the plan to ``out``. Returns solve's
    document (``predicted``, ``budgets``, ``compare`` rows)."""
    return cli_json(colibri, "solve", "--profile", prof, "--model", pack, "--heat", heat_path, "--ram",
                    f"{ram_gb:g}", "--context", context, "--prompt-tokens", prompt_tokens, "--out", out,
                    "--compare")


def export_llama(colibri: str, plan: Path) -> dict:
    """``export PLAN --to llama.cpp``: {"args", "patterns", "ngl", "notes", ...}."""
    return cli_json(colibri, "export", plan, "--to", "llama.cpp")


def hot_first_plan(prof: str, pack: Path, heat_path: Path, ram_gb: float, context: int, out: Path) -> str:
    """colibrì's hot-first fill (VRAM, then RAM pins, hottest first) at the same budget, written as a plan
    with our engine's knobs (bench/baseline_plan.py); returns its one-line summary."""
    r = subprocess.run([sys.executable, str(BENCH / "baseline_plan.py"), "--profile", prof, "--model",
                        str(pack), "--heat", str(heat_path), "--ram", f"{ram_gb:g}", "--context",
                        str(context), "--baseline", "hot-first", "--out", str(out)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench/baseline_plan.py failed ({r.returncode}): {r.stderr.strip()[-600:]}")
    return r.stdout.strip()


def verify_argv(colibri: str, plan: Path, pack: Path, n_tokens: int, ids: list[int], report: Path,
                reference: bool) -> list[str]:
    """``verify`` of ``plan`` (``--no-reference`` unless ``reference``), its report at ``report``."""
    return [colibri, "verify", "--plan", str(plan), "--model", str(pack), "--tokens", str(n_tokens),
            "--prompt-ids", ",".join(map(str, ids)), "--report", str(report),
            "--reference" if reference else "--no-reference", "--json"]


def verify_summary(doc: dict) -> dict:
    """The figures of a verify document kept per run: measured and predicted decode tok/s, the prefill
    (measured seconds and tok/s; the verdict's measured / predicted prefill tok/s ratio), hit rates,
    disk bytes per token, peak RSS, tokens, token-exactness and the verdict's ratios."""
    m, p, v = doc.get("measured", {}), doc.get("predicted", {}), doc.get("verdict") or {}
    prefill_s, n_prompt = m.get("prefill_s"), m.get("prompt_tokens")
    return {"tok_s": m.get("tok_s"), "predicted_tok_s": p.get("tok_s"), "tok_s_ratio": v.get("tok_s_ratio"),
            "prefill_s": prefill_s, "prompt_tokens": n_prompt,
            "prefill_tok_s": n_prompt / prefill_s if prefill_s and n_prompt else None,
            "prefill_ratio": v.get("prefill_ratio"),
            "hit_rate": m.get("hit_rate"), "predicted_hit_rate": p.get("hit_rate"),
            "disk_bytes_per_token": m.get("disk_bytes_per_token"),
            "predicted_disk_bytes_per_token": p.get("disk_bytes_per_token"),
            "disk_read_gbps": m.get("disk_read_gbps"), "peak_rss_bytes": m.get("peak_rss_bytes"),
            "load_s": m.get("load_s"), "o_direct": m.get("o_direct"), "tokens": m.get("tokens"),
            "token_exact": v.get("token_exact"), "ok": v.get("ok")}
