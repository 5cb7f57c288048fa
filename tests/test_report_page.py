"""report_page / report_plots: the self-contained HTML plan report, checked as text and in headless
Chromium (Debian's `chromium`, installed by `scripts/setup.sh test`; the browser test skips without it)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _cli_fixtures import invoke, pack_and_profile
from _reports import toy_report

from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.report import RunReport
from colibri_plan.report_page import build_page, write_page
from colibri_plan.report_plots import term_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A small fixture pack, a toy profile, a plan solved from them and a verify report of that plan."""
    d = pack_and_profile(tmp_path_factory, "report", plan=True)
    r = invoke("verify", "--plan", d / "plan.json", "--model", d / "fx", "--tokens", "2",
               "--report", d / "plan.verify.json")
    assert r.exit_code == 0, r.output
    return d


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_page_is_self_contained_with_every_part(planned):
    page = build_page(planned / "plan.json", [planned / "plan.verify.json"], time_limit_s=5)
    # nothing to fetch at view time: no script, no stylesheet link, no URL anywhere in an attribute
    assert "<script" not in page and "<link" not in page
    assert not re.search(r'(src|href)\s*=\s*["\']?(https?:|//)', page)
    for part in ("Machine", "Budgets and placement", "Placement", "Verify: predicted beside measured",
                 "What-if", "Exports", "colibrì", "llama.cpp", "-ot "):
        assert part in page, part
    images = _images(page)
    assert len(images) == 3  # heatmap, one verify chart, what-if curves
    assert all(img.startswith(PNG_MAGIC) and len(img) > 1000 for img in images)
    assert "PIN=" in page and "/tmp/tmp" not in page  # the env line names PLAN.coli_usage, not a temp file


def test_page_without_verify_reports_or_what_if_says_so(planned):
    page = build_page(planned / "plan.json", [], what_if=False)
    assert "No verify report given" in page and "Not computed (--no-what-if)" in page
    assert len(_images(page)) == 1


def test_plan_without_probabilities_has_no_curves_and_says_why(planned, tmp_path):
    doc = json.loads((planned / "plan.json").read_text())
    for layer in doc["layers"]:
        layer.pop("p", None)
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    page = build_page(tmp_path / "plan.json", [])
    assert "No what-if curves" in page and "selection probabilities per layer" in page
    assert len(_images(page)) == 1


def test_report_of_another_plan_is_flagged(planned, tmp_path):
    rep = toy_report()  # a minimal report: no comparison, no verdict, another plan and model
    (tmp_path / "other.verify.json").write_text(json.dumps(rep))
    page = build_page(planned / "plan.json", [tmp_path / "other.verify.json"], what_if=False)
    assert "verified another plan" in page and "ran another model" in page and "FAIL" in page


def test_bad_inputs_raise_typed_errors(planned, tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        build_page(tmp_path / "missing.json", [])
    with pytest.raises(FormatError):
        build_page(planned / "plan.json", [planned / "plan.json"])  # a plan is not a verify report
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(FormatError):
        build_page(tmp_path / "bad.json", [])


def test_write_page_is_atomic_and_refuses_a_folder(planned, tmp_path):
    out = write_page(planned / "plan.json", [], tmp_path / "r.html", what_if=False)
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert not list(tmp_path.glob(".r.html.*"))  # no temporary file left
    with pytest.raises(InputError):
        write_page(planned / "plan.json", [], tmp_path, what_if=False)


def test_progress_counts_every_part(planned):
    seen = []
    build_page(planned / "plan.json", [planned / "plan.verify.json"],
               progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, 5) for i in range(1, 6)]


def test_term_rows_add_attention_to_dense_and_keep_missing_sides():
    pred = RunReport.from_dict({"decode_s_per_token": 0.1, "tok_s": 10.0,
                                "terms": {"dense_s": 0.01, "attention_s": 0.002,
                                          "expert_compute_s": {"cpu": 0.03, "cuda:0": 0.01}}})
    meas = RunReport.from_dict({"decode_s_per_token": 0.2, "tok_s": 5.0,
                                "terms": {"dense_s": 0.015, "expert_compute_s": {"cpu": 0.05},
                                          "disk_wait_s": 0.1}})
    rows = {name: (p, m) for name, p, m in term_rows(pred, meas)}
    assert np.allclose(rows["dense + attention"], (12.0, 15.0))
    assert rows["expert compute cuda:0"] == (pytest.approx(10.0), None)
    assert rows["disk wait"] == (None, pytest.approx(100.0))


# ---- in a real browser ----------------------------------------------------------------------------------

def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed (Debian package "
                    "`chromium`; `bash scripts/setup.sh test` installs it as root)")
def test_page_renders_in_headless_chromium_without_console_errors(planned, tmp_path):
    from PIL import Image

    page = write_page(planned / "plan.json", [planned / "plan.verify.json"], tmp_path / "report.html",
                      time_limit_s=5)
    shot = tmp_path / "shot.png"
    args = [_chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
            "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1280,2000"]
    r = subprocess.run([*args, f"--screenshot={shot}", page.resolve().as_uri()], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    console = [ln for ln in r.stderr.splitlines() if ":CONSOLE" in ln]  # page errors, failed loads
    assert not console, console
    data = shot.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is None or len(colours) > 1  # None: more colours than maxcolors
    dom = subprocess.run([*args, "--dump-dom", page.resolve().as_uri()], capture_output=True, text=True,
                         timeout=120)
    assert "Plan report: fx" in dom.stdout
    assert dom.stdout.count("<img") == 3 and "What-if" in dom.stdout


#: injected into a copy of the page (the page itself has no script): every element whose right edge passes
#: the viewport, unless a scrolling ancestor inside the viewport clips it, posted to the frame's parent
_OVERFLOW_JS = """<script>addEventListener('load', () => {
  const vw = document.documentElement.clientWidth, bad = [];
  for (const el of document.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.right <= vw + 1) continue;
    let a = el.parentElement, clipped = false;
    while (a && a !== document.body) {
      const ox = getComputedStyle(a).overflowX;
      if (ox !== 'visible' && a.getBoundingClientRect().right <= vw + 1) { clipped = true; break; }
      a = a.parentElement;
    }
    if (!clipped) bad.push(el.tagName + '.' + el.className + ':' + Math.round(r.right));
  }
  parent.postMessage('OVERFLOW[' + vw + '|' + document.documentElement.scrollWidth + '|' + bad.join(',')
                     + ']', '*');
});</script>"""
#: headless Chromium's window is at least 500 px wide: a phone's width is an iframe of that width in it
_FRAME = """<!DOCTYPE html><html><body style="margin:0"><iframe src="{src}" style="border:0;width:{w}px;
height:2400px"></iframe><script>addEventListener('message', e => {{ const p = document.createElement('pre');
p.textContent = e.data; document.body.appendChild(p); }});</script></body></html>"""


def _overflow(page_html: str, tmp_path, width: int) -> tuple[int, int, list[str]]:
    """(viewport width, page scroll width, overflowing elements) of ``page_html`` in headless Chromium in a
    frame ``width`` CSS px wide; a screenshot of ``tmp_path / "report.html"`` in such a frame is left as
    ``tmp_path / f"shot-{width}.png"``."""
    (tmp_path / f"check-{width}.html").write_text(page_html.replace("</body>", _OVERFLOW_JS + "</body>"))
    for name, src in (("frame", f"check-{width}.html"), ("view", "report.html")):
        (tmp_path / f"{name}-{width}.html").write_text(_FRAME.format(src=src, w=width))
    args = [_chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / f'profile-{width}'}", f"--window-size={width},2400",
            "--virtual-time-budget=5000"]
    dom = subprocess.run([*args, "--dump-dom", (tmp_path / f"frame-{width}.html").as_uri()],
                         capture_output=True, text=True, timeout=120)
    m = re.search(r"OVERFLOW\[(\d+)\|(\d+)\|([^\]]*)\]", dom.stdout)
    assert m, dom.stderr[-2000:]
    subprocess.run([*args, f"--screenshot={tmp_path / f'shot-{width}.png'}",
                    (tmp_path / f"view-{width}.html").as_uri()], capture_output=True, timeout=120)
    return int(m.group(1)), int(m.group(2)), [b for b in m.group(3).split(",") if b]


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed")
@pytest.mark.parametrize("width", [1400, 420])
def test_no_element_overflows_the_viewport(planned, tmp_path, width):
    """Issue 29: at 420 px the tables overflowed and clipped; every table and chart now scrolls inside
    its own box and the page itself never scrolls sideways, at a desktop's and a phone's width."""
    page = write_page(planned / "plan.json", [planned / "plan.verify.json"], tmp_path / "report.html",
                      time_limit_s=5)
    vw, scroll, bad = _overflow(page.read_text(), tmp_path, width)
    assert abs(vw - width) <= 20          # the viewport is the asked width (less a scroll bar)
    assert bad == [] and scroll <= vw, (bad, scroll, vw)
    keep = os.environ.get("COLIBRI_REPORT_SHOTS")   # a folder to keep the screenshots in, to look at
    if keep:
        shutil.copy(tmp_path / f"shot-{width}.png", Path(keep) / f"report-{width}.png")
    assert (tmp_path / f"shot-{width}.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed")
def test_the_overflow_check_would_see_a_wide_table(tmp_path):
    """The check above is not vacuous: a table wider than a phone, outside a scrolling box, is caught."""
    (tmp_path / "report.html").write_text("<!DOCTYPE html><html><body>ok</body></html>")
    wide = "<table><tr>" + "<td>x0.9 measured/predicted</td>" * 12 + "</tr></table>"
    vw, scroll, bad = _overflow(f"<!DOCTYPE html><html><body>{wide}</body></html>", tmp_path, 420)
    assert scroll > vw and any(b.startswith("TABLE") for b in bad)


@pytest.mark.skipif(_chromium() is None, reason="headless Chromium is not installed")
def test_the_console_check_would_see_a_page_error(tmp_path):
    """The check above is not vacuous: a page that throws shows up as a CONSOLE line."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>throw new Error('boom')</script></body></html>")
    r = subprocess.run([_chromium(), "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr",
                        "--v=0", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", bad.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert any(":CONSOLE" in ln and "boom" in ln for ln in r.stderr.splitlines()), r.stderr[-2000:]


@pytest.mark.parametrize("section, value", [("comparison", "oops"), ("comparison", [1, 2]),
                                            ("comparison", {"a": 1}), ("verdict", {"tok_s_ratio": "x"}),
                                            ("settings", "x"), ("machine", "x"), ("model", "x"),
                                            ("row", "x")])
def test_badly_typed_verify_report_is_one_line_not_a_traceback(planned, tmp_path, section, value):
    rep = json.loads((planned / "plan.verify.json").read_text())
    if section == "row":
        rep["comparison"][0]["predicted"] = value
    elif section == "verdict":
        rep["verdict"].update(value)
    else:
        rep[section] = value
    (tmp_path / "x.json").write_text(json.dumps(rep))
    r = invoke("report", planned / "plan.json", tmp_path / "x.json", "--out", tmp_path / "r.html")
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "re-run colibri-plan verify" in r.output.replace("`", "")
    assert not (tmp_path / "r.html").exists()
    with pytest.raises(FormatError):
        build_page(planned / "plan.json", [tmp_path / "x.json"], what_if=False)


def test_header_shows_the_measured_figures_and_flags_the_prefill(planned, tmp_path):
    """Issue 29: with a PASS verify report attached the header showed only predictions, and a prefill
    off by x0.20 was visible only deep in the verify table."""
    rep = json.loads((planned / "plan.verify.json").read_text())
    page = build_page(planned / "plan.json", [planned / "plan.verify.json"], what_if=False)
    header = page[:page.index("<h2>Machine</h2>")]
    assert f"{rep['measured']['tok_s']:.3f}" in header and "measured decode tok/s (verify" in header
    assert f"x{rep['verdict']['tok_s_ratio']:.2f}" in header
    rep["verdict"].update(prefill_ratio=0.2, prefill_ok=False)
    (tmp_path / "slow.verify.json").write_text(json.dumps(rep))
    page = build_page(planned / "plan.json", [tmp_path / "slow.verify.json"], what_if=False)
    header = page[:page.index("<h2>Machine</h2>")]
    assert "<div class='card bad'><b>x0.20</b>" in header and "outside ±25%" in header
    assert "Prefill: measured x0.20 the predicted prefill tok/s" in page
    other = toy_report()   # another plan's report: no measured card in this plan's header
    (tmp_path / "other.verify.json").write_text(json.dumps(other))
    page = build_page(planned / "plan.json", [tmp_path / "other.verify.json"], what_if=False)
    assert "measured decode tok/s" not in page[:page.index("<h2>Machine</h2>")]


def test_heatmap_sorts_each_layer_by_heat(planned):
    from colibri_plan.formats.plan import layer_probabilities, load_plan
    from colibri_plan.report_plots import heat_order

    plan = load_plan(planned / "plan.json")
    probs = layer_probabilities(plan)
    order = heat_order(plan)
    sorted_p = np.take_along_axis(probs, order, axis=1)
    assert np.all(np.diff(sorted_p, axis=1) <= 0)                        # hottest first in every layer
    assert sorted(order[0].tolist()) == list(range(plan.n_experts))      # a permutation of the experts
    assert not np.array_equal(order, np.tile(np.arange(plan.n_experts), (len(order), 1)))
