"""The plan report page: one self-contained HTML file about a plan and its verify reports.

:func:`write_page` is what `colibri-plan report PLAN [VERIFY...] --out report.html` runs. The page holds
the machine the plan was solved for (the profile summary and the figures the cost model used), the
budgets, where every expert lives (a layer x expert heatmap), the predicted decode time per term, for
each verify report its verdict and predicted-beside-measured chart, the what-if curves rebuilt from the
plan (:func:`colibri_plan.planner.whatif.setup_from_plan`), and the exports for colibrì and llama.cpp.

Self-contained: inline CSS, pictures embedded as base64 PNG (:mod:`colibri_plan.report_plots`), no script,
no font, no link to fetch: it opens offline and can be mailed as one file. Library code: nothing here
prints; progress goes to an optional ``fn(done, total)`` callback. A bad PLAN or VERIFY file raises the
typed errors of the formats loaders; a part the plan cannot give (no what-if data, an export colibrì
cannot take) is said on the page instead.
"""

from __future__ import annotations

import base64
import html
import os
import tempfile
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from colibri_plan import __version__
from colibri_plan.errors import ColibriError
from colibri_plan.fileio import atomic_write_text, fingerprint
from colibri_plan.formats.plan import Plan, load_plan
from colibri_plan.formats.report import RunReport, load_report

#: what-if points per resource on the page (each is one solve)
WHATIF_POINTS = 7

_CSS = """
body{font-family:-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:0;background:#f4f5f7;
color:#1d2330}
main{max-width:1180px;margin:0 auto;padding:24px}
h1{font-size:24px;margin:0 0 4px;overflow-wrap:anywhere}
h2{font-size:18px;margin:0 0 12px;border-bottom:1px solid #e1e4e8;padding-bottom:6px}
h3{font-size:15px;margin:14px 0 8px;overflow-wrap:anywhere}
section{background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:16px 20px;margin:16px 0}
.sub{color:#5b6473;font-size:13px;overflow-wrap:anywhere}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin-top:14px}
.card{background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:10px 16px;min-width:150px}
.card b{display:block;font-size:22px}.card span{color:#5b6473;font-size:12px}
.card.bad{border-color:#d73a49;background:#fdf0f1}.card.good{border-color:#2e9e5b}
.tw{overflow-x:auto;max-width:100%}
table{border-collapse:collapse;font-size:13px;margin:4px 0 8px}
th,td{padding:4px 10px;border-bottom:1px solid #eef0f3;text-align:left}
th{background:#f6f8fa;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.fig{overflow-x:auto;max-width:100%;margin:8px 0}
.fig img{width:100%;min-width:640px;height:auto;display:block}
pre{background:#f6f8fa;border:1px solid #e1e4e8;border-radius:6px;padding:10px;white-space:pre-wrap;
word-break:break-all;font-size:12px}
code{overflow-wrap:anywhere}
.pass,.fail{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:700;
font-size:13px}
.pass{background:#2e9e5b}.fail{background:#d73a49}
.note{background:#fff8e1;border-left:4px solid #f0b429;padding:8px 12px;font-size:13px;margin:8px 0;
overflow-wrap:anywhere}
.grid{display:grid;grid-template-columns:minmax(0,1fr) minmax(0,1fr);gap:16px}
@media (max-width:760px){main{padding:8px}section{padding:12px 10px}.grid{grid-template-columns:minmax(0,1fr)}
.card{min-width:0;flex:1 1 40%}.card b{font-size:18px}}
"""


def _e(x) -> str:
    return html.escape(str(x))


def _table(header: Sequence[str], rows: Sequence[Sequence], numeric: Sequence[int] = ()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td class=n>{_e(c)}</td>" if i in numeric else f"<td>{_e(c)}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<div class=tw><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def _img(png: bytes, alt: str) -> str:
    """A chart in a scrolling box: on a phone it keeps a legible width (640 px) and scrolls sideways
    instead of shrinking its text below reading size."""
    return (f'<div class=fig><img alt="{_e(alt)}" '
            f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}"></div>')


def _gb(b) -> str:
    return "-" if b is None else f"{b / 1e9:,.2f} GB"


def _rate(v, unit: str = "GB/s") -> str:
    return "-" if v is None else f"{v:,.2f} {unit}"


def _ms(s) -> str:
    return "-" if s is None else f"{1e3 * s:.1f} ms"


def _measured_cards(reports: Sequence[tuple[str, dict]], plan_fp: str) -> list[tuple[str, str, str]]:
    """(value, label, css class) cards of the verify report of this plan (the last such one given): its
    measured decode tok/s with the verdict, measured/predicted, and the prefill verdict, flagged when it
    is outside the tolerance (``prefill_ok`` false) so that it is seen where the user looks first."""
    mine = [rep for _, rep in reports if isinstance(rep.get("plan"), dict)
            and rep["plan"].get("fingerprint") == plan_fp]
    if not mine:
        return []
    rep = mine[-1]
    v, meas = (x if isinstance(x, dict) else {} for x in (rep.get("verdict"), rep.get("measured")))
    ok = v.get("ok")
    mark = "good" if ok else "bad"
    cards = []
    if isinstance(meas.get("tok_s"), (int, float)):
        cards.append((f"{meas['tok_s']:.3f}", f"measured decode tok/s (verify {'PASS' if ok else 'FAIL'})",
                      mark))
    if isinstance(v.get("tok_s_ratio"), (int, float)):
        cards.append((f"x{v['tok_s_ratio']:.2f}", "measured / predicted decode tok/s", mark))
    pr = v.get("prefill_ratio")
    if isinstance(pr, (int, float)):
        pok = v.get("prefill_ok")
        cards.append((f"x{pr:.2f}", "measured / predicted prefill tok/s" + (
            "" if pok else ": outside ±25%, the time to first token is off"), "good" if pok else "bad"))
    return cards


def _header(plan: Plan, plan_path: str, reports: Sequence[tuple[str, dict]] = (), plan_fp: str = "") -> str:
    d, p = plan.doc, plan.doc["predicted"]
    counts = plan.counts()
    cards = [(f"{p['tok_s']:.3f}", "predicted decode tok/s", ""),
             (f"{1e3 * p['decode_s_per_token']:.1f} ms", "per token (predicted)", ""),
             (f"{100 * (1 - p['hit_rate']['disk']):.1f}%", "expert uses served from memory", ""),
             (f"{p['disk_bytes_per_token'] / 1e6:.1f} MB", "read from disk per token", ""),
             (f"{sum(v for k, v in counts.items() if k not in ('lru_slots', 'disk'))}"
              f" / {plan.n_experts * len(plan.layer_ids)}", "experts resident (VRAM + pinned)", "")]
    ttft = (p.get("prefill") or {}).get("ttft_s")
    if isinstance(ttft, (int, float)):
        cards.insert(2, (f"{ttft:.2f} s", f"time to first token ({p['prefill'].get('prompt_tokens', '?')}-"
                                          "token prompt, predicted)", ""))
    cards = _measured_cards(reports, plan_fp) + cards
    m = d["model"]
    return (f"<h1>Plan report: {_e(m.get('name', '?'))}</h1>"
            f"<div class=sub>plan <code>{_e(plan_path)}</code> · created {_e(d.get('created_utc', '?'))} · "
            f"{_e(d['expert_format'])} experts of {plan.expert_bytes:,} B · {len(plan.layer_ids)} MoE layers "
            f"x {plan.n_experts} experts, top-{_e(m.get('top_k'))} · model fingerprint "
            f"{_e(plan.model_fingerprint)}</div><div class=cards>"
            + "".join(f"<div class='card {c}'><b>{_e(v)}</b><span>{_e(t)}</span></div>" for v, t, c in cards)
            + "</div>")


def _machine(plan: Plan) -> str:
    prof, res = plan.doc["profile"], plan.doc.get("resources") or {}
    rows = [("profile", f"{prof.get('source') or '(not recorded)'} [{prof.get('fingerprint')}]"),
            ("CPU", f"{prof.get('cpu_model', '?')}, {prof.get('cores', '?')} cores"),
            ("RAM", f"{prof['ram_total_bytes'] / 2**30:.1f} GiB" if prof.get("ram_total_bytes") else "?"),
            ("GPUs", ", ".join(map(str, prof.get("gpus") or [])) or "none")]
    rows += [(label, _rate(res.get(key))) for label, key in (
        ("CPU expert matmul (1 token)", "cpu_matmul_gbps"), ("RAM read", "ram_read_gbps"),
        ("disk random read", "disk_read_gbps"), ("crc32 checks", "checksum_gbps"))]
    if res.get("disk_queue_depth"):
        rows.append(("disk queue depth (engine read threads)", res["disk_queue_depth"]))
    out = ("<h2>Machine</h2><p class=sub>The profile the plan was solved on and the figures the cost model "
           "took from it.</p>" + _table(["", ""], rows))
    gpus = res.get("gpus") or []
    if gpus:
        out += "<h3>GPUs as the cost model sees them</h3>" + _table(
            ["device", "matmul", "H2D", "D2H", "expert budget", "unified"],
            [(g["key"], _rate(g.get("matmul_gbps")), _rate(g.get("h2d_gbps")), _rate(g.get("d2h_gbps")),
              _gb(g.get("budget_bytes")), "yes" if g.get("unified") else "no") for g in gpus], (1, 2, 3, 4))
    return out


def _budgets(plan: Plan) -> str:
    b = plan.doc["budgets"]
    rows = [(e["what"], _gb(e["bytes"])) for e in b.get("explain", [])]
    rows += [(f"VRAM for experts on {k}", _gb(v)) for k, v in (b.get("vram_budget_bytes") or {}).items()]
    counts = plan.counts()
    p = plan.doc["predicted"]
    t, h = p["terms"], p["hit_rate"]
    terms = [("dense", t.get("dense_s")), ("attention", t.get("attention_s")),
             ("expert layers", t.get("expert_layers_s")), ("of which disk wait", t.get("disk_wait_s")),
             ("transfers", t.get("transfer_s"))]
    terms += [(f"expert compute {k}", v) for k, v in (t.get("expert_compute_s") or {}).items()]
    return ("<h2>Budgets and placement</h2><div class=grid><div>" + _table(["budget", "GB"], rows, (1,))
            + "</div><div>" + _table(["tier", "experts"], list(counts.items()), (1,))
            + _table(["predicted term", "per token"], [(k, _ms(v)) for k, v in terms], (1,))
            + _table(["served from", "share"], [(k, f"{100 * v:.1f}%") for k, v in h.items()], (1,))
            + "</div></div>")


def _fmt(v, unit: str) -> str:
    if v is None:
        return "-"
    shown = {"share": f"{100 * v:.1f}%", "B": f"{v / 1e6:.1f} MB", "s": f"{1e3 * v:.1f} ms"}
    return shown.get(unit, f"{v:.3f}")


def _prefill(v: dict) -> str:
    r = v.get("prefill_ratio")
    if not isinstance(r, (int, float)):
        return "n/a"
    return f"{r:.2f}" + ("" if v.get("prefill_ok") else " (outside ±25%)")


def _verify(i: int, path: str, report: dict, plan: Plan, plan_fp: str) -> tuple[str, bytes]:
    from colibri_plan.report_plots import terms_chart

    v = report["verdict"]
    badge = f"<span class={'pass' if v.get('ok') else 'fail'}>{'PASS' if v.get('ok') else 'FAIL'}</span>"
    exact = {True: "yes", False: "NO", None: "not checked"}.get(v.get("token_exact"), "?")
    ratio = v.get("tok_s_ratio")
    notes = []
    rp = report.get("plan") or {}
    if rp.get("fingerprint") != plan_fp:
        notes.append(f"This report verified another plan ({rp.get('path', '?')}, fingerprint "
                     f"{rp.get('fingerprint', '?')}), not the plan of this page: compare with care.")
    if (report.get("model") or {}).get("fingerprint") not in (None, plan.model_fingerprint):
        notes.append("This report ran another model than the plan's.")
    w = (report.get("machine") or {}).get("warning")
    if w:
        notes.append(str(w))
    if v.get("prefill_ok") is False and isinstance(v.get("prefill_ratio"), (int, float)):
        notes.append(f"Prefill: measured x{v['prefill_ratio']:.2f} the predicted prefill tok/s, outside the "
                     "±25% tolerance: the predicted time to first token does not hold on this machine (the "
                     "decode verdict above does not include it).")
    pred = RunReport.from_dict(report["predicted"], path, "predicted")
    meas = RunReport.from_dict(report["measured"], path, "measured")
    png = terms_chart(pred, meas, title=f"predicted vs measured: {Path(path).name}")
    s = report.get("settings") or {}
    rows = [(r.get("term", "?"), _fmt(r.get("predicted"), r.get("unit")),
             _fmt(r.get("measured"), r.get("unit")),
             f"{r['diff_points']:+.1f} pts" if "diff_points" in r else
             ("-" if r.get("ratio") is None else f"x{r['ratio']:.2f}")) for r in report.get("comparison", [])]
    html_ = (f"<h3>{i}. <code>{_e(path)}</code> {badge}</h3>"
             f"<p class=sub>token-exact {exact} · tok/s measured/predicted "
             f"{'n/a' if ratio is None else f'{ratio:.2f}'} · hit rate "
             f"{v.get('hit_rate_diff_points', 0):+.1f} pts · prefill measured/predicted "
             f"{_prefill(v)} · {_e(s.get('tokens', '?'))} decode steps on "
             f"{_e(s.get('cpu_backend', '?'))} · {_e(report.get('created_utc', ''))}</p>"
             + "".join(f"<div class=note>{_e(n)}</div>" for n in notes) + _img(png, f"verify report {i}")
             + _table(["term", "predicted", "measured", "measured/predicted"], rows, (1, 2, 3)))
    return html_, png


def _whatif(plan: Plan, time_limit_s: float, tick: Callable[[], None]) -> str:
    from colibri_plan.planner.whatif import setup_from_plan, what_if
    from colibri_plan.report_plots import whatif_chart

    head = ("<h2>What-if</h2><p class=sub>Predicted tok/s of a re-solved plan as one resource varies, beside "
            "colibrì's hot-first fill; everything else as in this plan.</p>")
    try:
        setup, notes = setup_from_plan(plan)
    except ColibriError as exc:
        tick()
        return head + f"<div class=note>No what-if curves: {_e(exc)}</div>"
    res = setup.res
    kinds = ["ram"] + (["vram"] if any(not g.unified for g in res.gpus) else []) \
        + (["nvme"] if res.disk_read_gbps is not None else [])
    curves, failed = {}, []
    for kind in kinds:
        try:
            curves[kind] = what_if(setup, kind, time_limit_s=time_limit_s)
        except ColibriError as exc:
            failed.append(f"what-if {kind}: {exc}")
    tick()
    current = {"ram": setup.problem.ram_budget_bytes / 1e9}
    if res.disk_read_gbps is not None:
        current["nvme"] = res.disk_read_gbps
    discrete = [g.budget_bytes for g in res.gpus if not g.unified]
    if discrete:
        current["vram"] = max(discrete) / 1e9
    out = head + "".join(f"<div class=note>{_e(n)}</div>" for n in notes + failed)
    if curves:
        out += _img(whatif_chart(curves, current), "what-if curves")
        for kind, rows in curves.items():
            out += f"<h3>{_e(kind)}</h3>" + _table(
                [kind, "tok/s (optimised)", "tok/s (hot-first)", "VRAM %", "pinned %", "disk %"],
                [(f"{r['value']:.3g} {r['unit']}", f"{r['tok_s']:.3f}", f"{r['hot_first_tok_s']:.3f}",
                  f"{100 * r['vram']:.1f}", f"{100 * r['ram_pinned']:.1f}", f"{100 * r['disk']:.1f}")
                 for r in rows], (0, 1, 2, 3, 4, 5))
    return out


def _exports(plan: Plan, plan_path: str) -> str:
    from colibri_plan.planner.exports import export_colibri, export_llama_cpp

    out = ("<h2>Exports</h2><p class=sub>The same placement for other engines (docs/exports.md); "
           "<code>colibri-plan export</code> writes the files.</p><h3>colibrì</h3>")
    try:  # the usage file itself is `export --to colibri`'s job: its default path is PLAN.coli_usage
        usage = str(Path(plan_path).with_suffix(".coli_usage"))
        with tempfile.TemporaryDirectory() as tmp:
            c = export_colibri(plan, os.path.join(tmp, "plan.coli_usage"))
            tmp_usage = os.path.join(tmp, "plan.coli_usage")
            env = c["env"].replace(tmp_usage, usage)
            notes = [n.replace(tmp_usage, usage) for n in c["notes"]]
        out += (f"<pre>{_e(env)}</pre><div class=sub># write {_e(usage)} with <code>colibri-plan export "
                f"{_e(plan_path)} --to colibri</code></div>")
        out += "".join(f"<div class=sub># {_e(n)}</div>" for n in notes)
    except ColibriError as exc:
        out += f"<div class=note>{_e(exc)}</div>"
    out += "<h3>llama.cpp</h3>"
    try:
        ll = export_llama_cpp(plan)
        out += f"<pre>{_e(ll['command'])}</pre>" + "".join(f"<div class=sub># {_e(n)}</div>"
                                                         for n in ll["notes"])
    except ColibriError as exc:
        out += f"<div class=note>{_e(exc)}</div>"
    return out


def build_page(plan_path: str | os.PathLike, verify_paths: Sequence[str | os.PathLike] = (), *,
               what_if: bool = True, time_limit_s: float = 10.0,
               progress: Callable[[int, int], None] | None = None) -> str:
    """The HTML text of the report page for ``plan_path`` and its verify reports.

    Args:
        what_if: re-solve the plan's problem at :data:`WHATIF_POINTS` values of each resource (seconds
            for a large model); False says so on the page instead.
        time_limit_s: solver seconds per what-if point.
        progress: optional ``fn(done, total)`` over the page's parts.

    Raises:
        InputError, FormatError: a missing or invalid plan or verify report (from the formats loaders).
    """
    from colibri_plan.report_plots import placement_heatmap, tier_legend

    plan = load_plan(plan_path)
    reports = [(str(p), load_report(p)) for p in verify_paths]
    total, done = 3 + len(reports) + (1 if what_if else 0), [0]

    def tick() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)

    plan_fp = fingerprint(plan.doc)
    body = [f"<section>{_header(plan, str(plan_path), reports, plan_fp)}</section>",
            f"<section>{_machine(plan)}</section>",
            f"<section>{_budgets(plan)}</section>"]
    tick()
    legend = ", ".join(label for label, _ in tier_legend(plan))
    body.append(f"<section><h2>Placement</h2><p class=sub>Each cell is one routed expert ({_e(legend)}); "
                "within each layer the experts are sorted by heat, hottest at the left, so each row reads "
                "as how far down the heat the fast tiers reach; the LRU slots of each layer are at its "
                "right.</p>"
                f"{_img(placement_heatmap(plan), 'placement heatmap')}</section>")
    tick()
    if reports:
        parts = []
        for i, (path, rep) in enumerate(reports, 1):
            parts.append(_verify(i, path, rep, plan, plan_fp)[0])
            tick()
        body.append("<section><h2>Verify: predicted beside measured</h2>" + "".join(parts) + "</section>")
    else:
        body.append("<section><h2>Verify</h2><div class=note>No verify report given: run <code>colibri-plan "
                    "verify --plan PLAN --model PACK</code> and pass its report to "
                    "<code>colibri-plan report</code>.</div></section>")
    if what_if:
        body.append(f"<section>{_whatif(plan, time_limit_s, tick)}</section>")
    else:
        body.append("<section><h2>What-if</h2><div class=note>Not computed (--no-what-if).</div></section>")
    body.append(f"<section>{_exports(plan, str(plan_path))}</section>")
    tick()
    sv, heat = plan.doc["solver"], plan.doc.get("heat") or {}
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body.append(f"<p class=sub>solver: {_e(sv.get('method', '?'))}, {_e(sv.get('status', '?'))} · heat: "
                f"{_e(heat.get('source', '(not recorded)'))} · page made by colibri-plan {_e(__version__)} "
                f"on {stamp}</p>")
    title = f"colibri-plan report: {plan.doc['model'].get('name', '')}"
    return (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>"
            f"<meta name=viewport content='width=device-width, initial-scale=1'><style>{_CSS}</style></head>"
            f"<body><main>{''.join(body)}</main></body></html>\n")


def write_page(plan_path: str | os.PathLike, verify_paths: Sequence[str | os.PathLike],
               out: str | os.PathLike, **kw) -> Path:
    """Build the page (:func:`build_page`, same keywords) and write it to ``out`` atomically.

    Raises:
        InputError: ``out`` cannot be written; and what :func:`build_page` raises.
    """
    return atomic_write_text(out, build_page(plan_path, verify_paths, **kw))
