"""Hand-edited input files are refused when loaded, with one line naming the file and the field: pack
indexes (arch, format, block, expert entries), plans, profiles and verify reports."""

import json
import math
import shutil

import pytest
from _reports import toy_report
from _solver_fixtures import toy_profile, toy_spec
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.engine.pack import open_pack
from colibri_plan.errors import FormatError
from colibri_plan.formats.pack_index import spec_from_pack
from colibri_plan.formats.pack_verify import verify_pack
from colibri_plan.formats.plan import load_plan
from colibri_plan.formats.profile import validate_profile
from colibri_plan.planner.calibrate import fit_coefficients
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions
from colibri_plan.verify import load_report, save_report


def cli_run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_one_line(r, *parts):
    """exit 1, no traceback, one error line on stderr holding every part."""
    assert r.exit_code == 1, (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("Error")]
    assert len(lines) == 1, r.stderr
    for p in parts:
        assert p in lines[0], (p, lines[0])


# ---- packs ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("packs") / "fx"
    r = cli_run("model", "fixture", "--small", "--layers", "2", "--experts", "8", "--top-k", "2", out)
    assert r.exit_code == 0, r.output
    return out


def edited_pack(pack, tmp_path, edit):
    bad = tmp_path / "bad"
    shutil.copytree(pack, bad)
    doc = json.loads((bad / "pack.json").read_text())
    edit(doc)
    (bad / "pack.json").write_text(json.dumps(doc))   # NaN as the bare word a hand edit leaves
    return bad


def _set(section, key, value):
    return lambda d: d[section].__setitem__(key, value)


def _entry(i, value):
    return lambda d: d["experts"][0].__setitem__(i, value)


PACK_EDITS = [
    (_set("arch", "rms_norm_eps", math.nan), "arch.rms_norm_eps must be a finite number"),
    (_set("arch", "rms_norm_eps", 0.0), "rms_norm_eps must be > 0"),
    (_set("arch", "rope_theta", "x"), "arch.rope_theta must be a finite number"),
    (_set("arch", "vocab_size", 0), "vocab_size must be > 0"),
    (_set("arch", "n_heads", 0), "n_heads must be > 0"),
    (_set("arch", "hidden_size", -256), "hidden_size must be > 0"),
    (_set("arch", "top_k", 0), "top_k 0 must be in 1..n_experts"),
    (_set("arch", "top_k", 9), "top_k 9 must be in 1..n_experts (8)"),
    (_set("arch", "n_layers", 1.5), "arch.n_layers must be a whole number"),
    (_set("arch", "moe_layers", [0, 1, 5]), "moe_layers must be distinct ascending ids in 0..1"),
    (_set("arch", "norm_topk_prob", "yes"), "arch.norm_topk_prob must be true or false"),
    (_set("format", "experts_file", "/etc/passwd"), "format.experts_file must be a plain file name"),
    (_set("format", "experts_file", "../heat.json"), "format.experts_file must be a plain file name"),
    (_set("format", "dense_file", "../../etc/passwd"), "format.dense_file must be a plain file name"),
    (_set("format", "experts_file", "other.bin"), "this version reads only 'experts.bin'"),
    (_set("format", "dense_format", "zzz"), "format.dense_format 'zzz' is not a known format"),
    (_set("format", "dense_crc32", 2**32), "format.dense_crc32"),
    (_set("block", "payload_bytes", 10**12), "block.payload_bytes is 1000000000000, but int4"),
    (_set("block", "block_bytes", 1e12), "block.block_bytes must be a non-negative whole number"),
    (_set("block", "width", 256), "block geometry (hidden 256, width 256) differs from arch"),
    (_entry(2, -4096), "experts[0] must be [layer, expert, offset, nbytes, crc32]"),
    (_entry(3, "53248"), "experts[0] must be [layer, expert, offset, nbytes, crc32]"),
    (_entry(4, math.nan), "experts[0] must be [layer, expert, offset, nbytes, crc32]"),
    (_entry(4, 2**32), "experts[0] crc32 4294967296 is not a 32-bit crc"),
    (_entry(2, 10**9), "experts[0] bytes 1000000000..1000053248 lie beyond format.experts_file_bytes"),
]


@pytest.mark.parametrize("edit, msg", PACK_EDITS)
def test_bad_pack_index_is_refused_at_load(pack, tmp_path, edit, msg):
    bad = edited_pack(pack, tmp_path, edit)
    for fn in (open_pack, verify_pack, spec_from_pack):   # run, model verify, model show / solve
        with pytest.raises(FormatError, match="pack.json") as ei:
            fn(bad)
        assert msg in str(ei.value)
    assert_one_line(cli_run("model", "verify", bad), str(bad / "pack.json"), msg)


def test_pack_cli_commands_refuse_a_bad_arch(pack, tmp_path):
    bad = edited_pack(pack, tmp_path, _set("arch", "rms_norm_eps", math.nan))
    assert_one_line(cli_run("model", "show", bad), "arch.rms_norm_eps")
    r = cli_run("run", "--model", bad, "--prompt-ids", "1,2", "--tokens", "2")
    assert_one_line(r, "arch.rms_norm_eps")


def test_untouched_pack_still_verifies_and_runs(pack):
    assert verify_pack(pack)["ok"]
    r = cli_run("run", "--model", pack, "--prompt-ids", "1,2", "--tokens", "2", "--json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["tokens"]) == 2


# ---- plans ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_doc():
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024)          # 3.15 MB experts, 48 in all
    prof = toy_profile(ram_available_bytes=3 * 10**9)
    plan, _, _ = make_plan(prof, spec, None, SolveOptions(ram="0.58", context_tokens=100, trunk="cpu"))
    return plan.doc


def _plan_file(tmp_path, doc, edit):
    doc = json.loads(json.dumps(doc))
    edit(doc)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(doc))
    return f


@pytest.mark.parametrize("edit, msg", [
    (lambda d: d.__setitem__("dense_format", "zzz"), "dense_format 'zzz' is not a known quant format"),
    (lambda d: d.__setitem__("expert_format", "int3"), "expert_format 'int3' is not a known quant format"),
    (lambda d: d["model"].__setitem__("top_k", 10**18), "model.top_k 1000000000000000000 is more than"),
    (lambda d: d["predicted"].update(decode_s_per_token=0, tok_s=2551),
     "predicted.decode_s_per_token must be > 0"),
    (lambda d: d["predicted"].__setitem__("tok_s", 2551.0), "is not 1 / predicted.decode_s_per_token"),
])
def test_bad_plan_is_refused(tmp_path, plan_doc, edit, msg):
    with pytest.raises(FormatError, match="plan.json") as ei:
        load_plan(_plan_file(tmp_path, plan_doc, edit))
    assert msg in str(ei.value)


def test_plan_without_resources_or_coefficients_still_loads(tmp_path, plan_doc):
    f = _plan_file(tmp_path, plan_doc, lambda d: [d.pop("resources", None), d.pop("coefficients", None)])
    assert load_plan(f).doc["predicted"]["tok_s"] == pytest.approx(plan_doc["predicted"]["tok_s"])


# ---- profiles -------------------------------------------------------------------------------------
def _fig(median, lo, hi):
    return {"min": lo, "median": median, "max": hi, "repetitions": 3}


def _ffn():
    return {"backend": "cuda", "device_index": 0, "fmt": "int4", "experts": 8, "tokens": 1,
            "seconds": _fig(1e-3, 1e-3, 1e-3), "weight_gbps": _fig(100.0, 90.0, 110.0)}


def _profile(edit):
    doc = json.loads(json.dumps(toy_profile().doc))
    edit(doc)
    return doc


@pytest.mark.parametrize("edit, msg", [
    (lambda d: d["ram"].__setitem__("checksum_gbps", _fig(0, 12, 12)), "ram.checksum_gbps: expected min <= "),
    (lambda d: d["ram"].__setitem__("checksum_gbps", _fig(0, 0, 0)),
     "ram.checksum_gbps: figures must be > 0"),
    (lambda d: d.__setitem__("expert_ffn", []), "expert_ffn: empty list"),
    (lambda d: d.__setitem__("expert_ffn", [{**_ffn(), "weight_gbps": _fig(math.nan, 1, 1)}]),
     "expert_ffn[0].weight_gbps: median must be a finite number"),
    (lambda d: d.__setitem__("expert_ffn", [{**_ffn(), "tokens": 0}]), "tokens must be an integer >= 1"),
])
def test_bad_profile_figures_are_refused(edit, msg):
    with pytest.raises(FormatError) as ei:
        validate_profile(_profile(edit))
    assert msg in str(ei.value)


def test_good_optional_profile_figures_pass():
    validate_profile(_profile(lambda d: d.pop("expert_ffn", None)))                  # absent is fine
    doc = _profile(lambda d: [d["ram"].__setitem__("checksum_gbps", _fig(12, 11, 13)),
                              d.__setitem__("expert_ffn", [_ffn()])])
    assert validate_profile(doc)["ram"]["checksum_gbps"]["median"] == 12


# ---- verify reports -------------------------------------------------------------------------------
def _report(cpu=0.2, disk=0.3, layers=True):
    return toy_report(cpu, disk, layers=layers)


def _raw_report(tmp_path, rep):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"kind": "verify-report", "schema_version": 1, **rep}))
    return f


@pytest.mark.parametrize("section, key, value, msg", [
    ("measured", "decode_s_per_token", math.nan, "measured.decode_s_per_token must be a finite number"),
    ("measured", "decode_s_per_token", 1e300, "measured.decode_s_per_token must be a finite number >= 0 and"),
    ("measured", "tok_s", math.inf, "measured.tok_s must be a finite number"),
])
def test_bad_report_totals_are_refused(tmp_path, section, key, value, msg):
    rep = _report()
    rep[section][key] = value
    with pytest.raises(FormatError, match="r.json") as ei:
        load_report(_raw_report(tmp_path, rep))
    assert msg in str(ei.value)


def test_huge_report_term_is_refused_by_load_and_calibrate(tmp_path):
    rep = _report()
    rep["measured"]["terms"]["expert_cpu_s"] = 1e300
    msg = r"measured.terms.expert_cpu_s must be a finite number >= 0 and <= 1e\+06"
    with pytest.raises(FormatError, match=msg):
        load_report(_raw_report(tmp_path, rep))
    with pytest.raises(FormatError, match="expert_cpu_s"):
        fit_coefficients([rep], names=["r.json"])
    f = save_report(_report(), tmp_path / "ok.json")
    assert_one_line(cli_run("calibrate", _raw_report(tmp_path, rep), "--out", tmp_path / "c.json"),
                    "measured.terms.expert_cpu_s")
    assert f.is_file()


def test_report_without_cpu_path_layers_warns():
    old = [_report(disk=0.0, layers=False), _report(layers=False)]
    _, detail = fit_coefficients(old, names=["a.json", "b.json"])
    hits = [w for w in detail["warnings"] if "predates per-layer" in w]
    assert len(hits) == 2 and hits[0].startswith("a.json") and "older additive form" in hits[0]
    _, detail = fit_coefficients([_report(disk=0.0), _report()], names=["a.json", "b.json"])
    assert not [w for w in detail["warnings"] if "predates per-layer" in w]
