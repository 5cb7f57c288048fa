"""``colibri-plan calibrate --engine llama.cpp REPLAY.json``: llama.cpp's own coefficients from replays.

A replay (``bench/replay_llamacpp.py placements``, kind ``replay-llamacpp``) measured llama-bench's
decode (tg) and prefill (pp) tok/s of several placements of one GGUF under one memory limit. Each
placement becomes a :class:`~.llamacpp_cost.LlamaPlacement` (its ``-ot`` patterns matched against
llama.cpp's tensor names ``blk.L.ffn_{gate,up,down}_exps.weight`` as its loader does: the first pattern
that ``regex_search``-matches wins; ``--cpu-moe``, ``--n-cpu-moe N``, ``-ngl``, ``--load-mode none``),
priced raw (:func:`~.llamacpp_cost.raw_terms`) with the profile's figures, and the measured seconds per
token are fitted:

* decode: ``1 / tg tok/s ≈ c_cpu · cpu_s + c_gpu · gpu_s + c_fault · fault_s + split_s · splits + graph_s
  + c_norepack · norepack_s`` by non-negative least squares (``scipy.optimize.nnls``); a term that is
  zero in every row keeps its base value, and a design that cannot tell its columns apart (smallest
  over largest singular value of the column-scaled design < :data:`COLLINEAR_TOL`) drops ``graph_s``,
  then ``split_s`` (base values kept).
* prefill: ``1 / pp tok/s − (c_fault · pp_fault_s + split_s · pp_splits + graph_s · pp_graph)`` ≈
  ``c_pp_cpu · pp_cpu_s + c_pp_gpu · pp_gpu_s + c_xfer · xfer_s``, the same way.

The document written (kind ``llamacpp-coefficients``, schema_version 1) holds the coefficients, what they
were fitted on, and every row predicted beside measured; ``solve --llama-coefficients FILE`` reads it.
"""

from __future__ import annotations

import dataclasses
import re
from datetime import datetime, timezone

import numpy as np

from colibri_plan.errors import FormatError, InputError
from colibri_plan.fileio import read_document, read_json_object, write_document
from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At
from colibri_plan.planner.llamacpp_cost import (
    PROJECTIONS,
    LlamaCoefficients,
    LlamaPlacement,
    decode_seconds,
    prefill_seconds,
    raw_terms,
)

KIND = "llamacpp-coefficients"
SCHEMA_VERSION = 1
REPLAY_KIND = "replay-llamacpp"
COLLINEAR_TOL = 1e-3
_REDO = "re-run bench/replay_llamacpp.py placements (its JSON is read as written)"
_COEF_REDO = "re-create it with `colibri-plan calibrate --engine llama.cpp REPLAY.json`"


def host_projections(overrides: list[str], n_layers: int, cpu_moe: bool = False,
                     n_cpu_moe: int | None = None) -> dict:
    """{layer: projections in host buffers} of ``-ot`` patterns (``PATTERN=BUFFER``; only ``=CPU`` ones
    keep a tensor on the host), ``--cpu-moe`` (every layer) and ``--n-cpu-moe N`` (the first N layers).

    Raises:
        InputError: a pattern without ``=`` or not a regular expression.
    """
    rules = []
    for o in overrides:
        pat, sep, buf = str(o).rpartition("=")
        if not sep or not pat:
            raise InputError(f"-ot {o!r}: expected PATTERN=BUFFER (e.g. blk\\.3\\.ffn_down_exps=CPU)")
        try:
            rules.append((re.compile(pat), buf.strip().upper() == "CPU"))
        except re.error as exc:
            raise InputError(f"-ot {o!r}: not a regular expression ({exc})") from None
    out = {}
    for lay in range(n_layers):
        hp = []
        for proj in PROJECTIONS:
            name = f"blk.{lay}.ffn_{proj}_exps.weight"
            hit = next((cpu for rx, cpu in rules if rx.search(name)), None)   # first match wins
            if cpu_moe or (n_cpu_moe is not None and lay < n_cpu_moe) or hit:
                hp.append(proj)
        if hp:
            out[lay] = tuple(hp)
    return out


def _placement(row: dict, at: At, n_layers: int, settings: dict, has_gpu: bool) -> LlamaPlacement:
    """A replay row as a LlamaPlacement (llama-bench's context is prompt + generated tokens)."""
    overrides = f.items(row, "overrides", at, optional=True) or []
    ncm = row.get("n_cpu_moe")
    if ncm is not None:
        f.whole(row, "n_cpu_moe", at, lo=0)
    ngl = row.get("ngl")
    ngl = (n_layers + 1 if ngl is None or ngl < 0 else int(ngl)) if has_gpu else 0
    lm = row.get("load_mode")
    return LlamaPlacement(ngl=ngl, cpu_experts=host_projections(overrides, n_layers, bool(row.get("cpu_moe")),
                                                                ncm),
                          context=int(settings["context"]),
                          ubatch=int(row.get("ubatch") or settings["ubatch"]),  # a pick's own -ub
                          threads=int(settings["threads"]), load="no-mmap" if lm == "none" else "mmap",
                          repack=row.get("repack") is not False)


def replay_rows(doc: dict, name: str, geometry, machine) -> list[dict]:
    """Every measured placement of a replay document: {"file", "placement", "terms", "decode_s",
    "prefill_s"} (seconds per token; None when that test failed).

    Raises:
        FormatError: not a replay-llamacpp document, or a field of the wrong type (named).
    """
    at = At(name, _REDO, repr_values=True)
    if doc.get("kind") != REPLAY_KIND:
        raise FormatError(f"{name} is a {doc.get('kind')!r} file, expected {REPLAY_KIND!r} "
                          "(bench/replay_llamacpp.py placements)")
    if doc.get("mode", "placements") != "placements":
        raise FormatError(f"{name}: mode {doc.get('mode')!r}; only 'placements' replays calibrate")
    s = f.mapping(doc, "settings", at)
    for k in ("context", "ubatch", "threads"):
        f.whole(s, k, at / "settings", lo=1)
    has_gpu = any(("CUDA" in str(t.get("backends", ""))) or ("Vulkan" in str(t.get("backends", "")))
                  for r in doc.get("placements") or [] for run in r.get("runs") or [] if isinstance(run, dict)
                  for t in run.get("tests") or [] if isinstance(t, dict))
    out = []
    for row, here in f.each(doc, "placements", at, nonempty=True):
        f.document(row, here)

        def sec(key, row=row, here=here):
            st = f.mapping(row, key, here, optional=True)
            return None if st is None else 1.0 / f.number(st, "median", here / key, lo=0, lo_open=True)
        pl = _placement(row, here, geometry.n_layers, s, has_gpu)
        d, p = sec("decode_tok_s"), sec("prefill_tok_s")
        if d is None and p is None:
            continue
        out.append({"file": name, "placement": str(row.get("name", "?")), "llama_placement": pl,
                    "terms": raw_terms(geometry, machine, pl), "decode_s": d, "prefill_s": p})
    return out


def _nnls(cols: list[str], rows: list[dict], y: np.ndarray, drop_order: tuple) -> dict:
    """Non-negative least squares of ``y`` on the named term columns; columns all zero, then (when the
    design is collinear) those of ``drop_order`` in turn, are left out. Returns {column: value}."""
    from scipy.optimize import nnls

    keep = [c for c in cols if any(r["terms"][c] > 0 for r in rows)]
    while keep:
        x = np.array([[r["terms"][c] for c in keep] for r in rows], dtype=np.float64)   # [rows, cols]
        scale = np.linalg.norm(x, axis=0)
        sv = np.linalg.svd(x / scale, compute_uv=False)
        if len(rows) >= len(keep) and sv[-1] / sv[0] >= COLLINEAR_TOL:
            sol, _ = nnls(x / scale, y)
            return dict(zip(keep, sol / scale))
        drop = next((c for c in drop_order if c in keep), keep[-1])
        keep.remove(drop)
    return {}


DECODE_COEF = {"cpu_s": "c_cpu", "gpu_s": "c_gpu", "fault_s": "c_fault", "splits": "split_s",
               "graph": "graph_s", "norepack_s": "c_norepack"}
PREFILL_COEF = {"pp_cpu_s": "c_pp_cpu", "pp_gpu_s": "c_pp_gpu", "xfer_s": "c_xfer",
                "pp_norepack_s": "c_pp_norepack"}


def fit(rows: list[dict], fitted_on: list[str], base: LlamaCoefficients | None = None) -> tuple:
    """(LlamaCoefficients, detail) fitted on replay ``rows`` (:func:`replay_rows`); detail has each row
    predicted beside measured and the largest relative errors.

    Raises:
        InputError: no measured row.
    """
    base = base or LlamaCoefficients()
    dec = [r for r in rows if r["decode_s"] is not None]
    pre = [r for r in rows if r["prefill_s"] is not None]
    if not dec and not pre:
        raise InputError("the replay files hold no measured placement (every llama-bench run failed); "
                         "re-run the replay")
    vals = dataclasses.asdict(base)
    if dec:
        got = _nnls(list(DECODE_COEF), dec, np.array([r["decode_s"] for r in dec]), ("graph", "splits"))
        vals.update({DECODE_COEF[k]: float(v) for k, v in got.items()})
    c = LlamaCoefficients(**{**vals, "fitted_on": ()})
    if pre:
        t = [r["terms"] for r in pre]
        y = np.array([r["prefill_s"] - (c.c_fault * x["pp_fault_s"] + c.split_s * x["pp_splits"]
                                        + c.graph_s * x["pp_graph"]) for r, x in zip(pre, t)])
        got = _nnls(list(PREFILL_COEF), pre, np.maximum(y, 0.0), ())
        vals.update({PREFILL_COEF[k]: float(v) for k, v in got.items()})
    coef = LlamaCoefficients(**{**vals, "fitted_on": tuple(fitted_on)})
    return coef, {**priced(rows, coef), "method": "nnls on seconds per token (planner/llamacpp_calibrate.py)"}


def priced(rows: list[dict], coef: LlamaCoefficients) -> dict:
    """Replay ``rows`` (:func:`replay_rows`) priced with ``coef`` beside what was measured: {"rows": [{file,
    placement, decode_tok_s, prefill_tok_s: {measured, predicted}}], "decode_rows", "prefill_rows",
    "max_rel_error": {decode, prefill}}. With coefficients fitted on other replays this is an
    out-of-sample check (``bench/replay_check.py``)."""
    dec = [r for r in rows if r["decode_s"] is not None]
    pre = [r for r in rows if r["prefill_s"] is not None]
    table = []
    for r in rows:
        pd, pp = decode_seconds(r["terms"], coef), prefill_seconds(r["terms"], coef)
        table.append({"file": r["file"], "placement": r["placement"],
                      "decode_tok_s": {"measured": 1 / r["decode_s"] if r["decode_s"] else None,
                                       "predicted": 1 / pd if pd > 0 else None},
                      "prefill_tok_s": {"measured": 1 / r["prefill_s"] if r["prefill_s"] else None,
                                        "predicted": 1 / pp if pp > 0 else None}})

    def worst(key):
        errs = [abs(t[key]["predicted"] / t[key]["measured"] - 1) for t in table
                if t[key]["measured"] and t[key]["predicted"]]
        return max(errs) if errs else None
    return {"rows": table, "decode_rows": len(dec), "prefill_rows": len(pre),
            "max_rel_error": {"decode": worst("decode_tok_s"), "prefill": worst("prefill_tok_s")}}


def fitted_on_line(doc: dict, name: str, n_rows: int) -> str:
    """One line naming a replay: its file, placements, machine, model and budget."""
    m, b = doc.get("machine") or {}, doc.get("budget") or {}
    model = doc.get("model") or {}
    limit = (f"a {b['vram_gb']} GB VRAM budget" if b.get("vram_gb") is not None
             else f"a {b.get('ram_gb', '?')} GB limit")
    return (f"{name}: {n_rows} llama.cpp placement(s) of a {model.get('quant', '?')} "
            f"{model.get('n_layers', '?')}-layer model at {limit} on a "
            f"{m.get('cores', '?')}-core {m.get('cpu', '?')}")


def read_replay(path: str) -> dict:
    """A replay JSON document (kind checked by :func:`replay_rows`). Raises InputError/FormatError."""
    return read_json_object(path, "replay file")


def save(coef: LlamaCoefficients, path: str, detail: dict, sources: list[str]):
    """Write the llama.cpp coefficients document atomically."""
    body = {"created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "coefficients": coef.to_dict(), "detail": detail, "fitted_from": list(sources)}
    return write_document(path, KIND, SCHEMA_VERSION, body)


def load(path: str) -> LlamaCoefficients:
    """Read a llama.cpp coefficients document.

    Raises:
        InputError: missing file. FormatError: another kind, or a coefficient not a finite number >= 0.
    """
    doc = read_document(path, KIND, SCHEMA_VERSION)
    at = At(str(path), _COEF_REDO, repr_values=True)
    c = f.mapping(doc, "coefficients", at)
    vals = {fl.name: f.number(c, fl.name, at / "coefficients", lo=0, optional=True)
            for fl in dataclasses.fields(LlamaCoefficients) if fl.name != "fitted_on"}
    on = f.items(c, "fitted_on", at / "coefficients", optional=True) or []
    if not all(isinstance(x, str) for x in on):
        (at / "coefficients" / "fitted_on").bad("a list of strings", on)
    return LlamaCoefficients(**{k: v for k, v in vals.items() if v is not None}, fitted_on=tuple(on))


def calibrate_replays(paths: list[str], profiles: list[str], models: list[str], load_spec,
                      base: LlamaCoefficients | None = None) -> tuple:
    """Fit llama.cpp's coefficients on replay files: (coefficients, detail).

    ``profiles`` / ``models``: one for every replay, one for all, or none (then each replay's own
    ``ours.profile`` and ``model.gguf``); the model gives the geometry, its bytes at the replay's GGUF type.
    ``load_spec``: ``fn(path) -> ModelSpec`` (the CLI passes ``colibri_plan.model.load_model_spec``: the
    planner does not read checkpoints itself).

    Raises:
        InputError: counts that do not match, a replay naming no profile/model that exists; FormatError:
        a replay that is not one.
    """
    rows, names = replay_rows_of(paths, profiles, models, load_spec)
    return fit(rows, names, base)


def replay_rows_of(paths: list[str], profiles: list[str], models: list[str], load_spec) -> tuple:
    """(rows of every replay priced raw, one line naming each replay): :func:`calibrate_replays`'s
    inputs."""
    from colibri_plan.formats.profile import resolve_profile
    from colibri_plan.planner.budgets import resources_from_profile
    from colibri_plan.planner.llamacpp_inputs import GGUF_BITS, geometry, machine, profile_format

    def pick(given: list[str], i: int, what: str) -> str | None:
        if len(given) not in (0, 1, len(paths)):
            raise InputError(f"give --{what} once, or once per replay ({len(paths)}), not {len(given)} times")
        return given[0] if len(given) == 1 else given[i] if given else None

    rows, names = [], []
    for i, path in enumerate(paths):
        doc = read_replay(path)
        if doc.get("kind") != REPLAY_KIND:
            raise FormatError(f"{path} is a {doc.get('kind')!r} file, expected {REPLAY_KIND!r} "
                              "(bench/replay_llamacpp.py placements)")
        at = At(path, _REDO, repr_values=True)
        model = f.mapping(doc, "model", at)
        budget = f.mapping(doc, "budget", at)
        limit = f.number(budget, "limit_bytes", at / "budget", lo=0, lo_open=True)
        prof_path = pick(profiles, i, "profile") or (doc.get("ours") or {}).get("profile")
        model_path = pick(models, i, "model") or model.get("gguf")
        if not prof_path or not model_path:
            raise InputError(f"{path}: name the profile and model it was measured with (--profile, --model)")
        profile, _ = resolve_profile(prof_path)
        spec = load_spec(model_path)
        quant = str(model.get("quant") or "")
        bpw = model.get("block_bits_per_weight") or GGUF_BITS.get(quant.upper())
        if not isinstance(bpw, (int, float)) or isinstance(bpw, bool) or not 1 <= bpw <= 32:
            (at / "model" / "block_bits_per_weight").bad("bits per weight in 1..32", bpw)
        fmt = profile_format(profile, quant)
        if fmt is None:
            raise InputError(f"{prof_path}: no CPU matmul row; profile the machine the replay ran on")
        res = resources_from_profile(profile, spec.with_format(fmt) if fmt != spec.expert_format else spec,
                                     {}, fmt=fmt)
        g = geometry(spec, float(bpw), quant)
        got = replay_rows(doc, path, g, machine(profile, res, int(limit), 0))
        rows += got
        names.append(fitted_on_line(doc, path, len(got)))
    return rows, names


def check_replays(paths: list[str], profiles: list[str], models: list[str], load_spec,
                  coef: LlamaCoefficients) -> dict:
    """Replays priced with given coefficients, nothing fitted (:func:`priced`'s detail, plus
    ``checked_with``: what the coefficients were fitted on). Arguments and errors as
    :func:`calibrate_replays`."""
    rows, _ = replay_rows_of(paths, profiles, models, load_spec)
    return {**priced(rows, coef), "checked_with": list(coef.fitted_on)}
