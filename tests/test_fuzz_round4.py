"""The bad inputs the fourth fuzzing round found (issue 30, "Bad inputs found (round 4)"), one case each
where the mutation suites (test_fuzz_documents.py, test_fuzz_loaders.py) would only meet them by chance:
hand-edited plans, profiles, heat traces, verify reports and configs that used to pass and change a
result silently, or crash after the work. Each must now be refused up front with a one-line typed error
that says what was wrong and what to do. Items 2-4, 7 and 17 are in test_fuzz_loaders.py,
test_fileio.py and test_cli_common.py.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.errors import FormatError
from colibri_plan.formats.profile import MachineProfile

# ---- item 13: profile figures that contradict each other or the probe -----------------------------

def _trunk_row(backend: str, path: str) -> dict:
    st = {"min": 1e-4, "median": 2e-4, "max": 3e-4, "repetitions": 3}
    return {"backend": backend, "device_index": 0, "device_name": "d", "path": path, "fmt": "int8",
            "hidden": 2048, "n_heads": 32, "n_kv_heads": 4, "head_dim": 128, "context_tokens": 64,
            "layers": 8, "weight_bytes": 18_000_000, "block_seconds": st, "moe_layer_seconds": st,
            "handoff_seconds": st, "attention_seconds": st}


@pytest.mark.parametrize("backend, path", [("cpu", "device"), ("cuda", "host")])
def test_a_trunk_layer_row_relabelled_to_the_other_path_is_refused(backend, path):
    doc = toy_profile().doc
    MachineProfile({**doc, "trunk_layer": [_trunk_row(backend, "host" if path == "device" else "device")]})
    with pytest.raises(FormatError, match=f"path '{path}' on backend '{backend}'.*re-measure"):
        MachineProfile({**doc, "trunk_layer": [_trunk_row(backend, path)]})


def test_available_ram_above_total_ram_is_refused():
    doc = copy.deepcopy(toy_profile().doc)
    doc["machine"]["ram_available_bytes"] = 950_000 * 10**9
    with pytest.raises(FormatError, match="ram_available_bytes 950,000,000,000,000 is more than ram_total"):
        MachineProfile(doc)


# ---- items 5, 6, 10, 14: hand-edited plans -----------------------------------------------------------

@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    from colibri_plan.formats.heat import Heat
    from colibri_plan.formats.plan import save_plan
    from colibri_plan.planner.make import make_plan
    from colibri_plan.planner.options import SolveOptions

    prof = toy_profile(gpus=[{"gbps": 60.0, "free_bytes": 4 * 10**9}], ram_available_bytes=8 * 10**9)
    heat = Heat(n_experts=8, layers=(1, 2, 3), counts=np.array([[3, 1, 0, 0, 2, 0, 1, 1]] * 3), top_k=2,
                tokens=4, n_model_layers=4)
    plan, _, _ = make_plan(prof, toy_spec(n_experts=8), heat, SolveOptions(ram="4", context_tokens=100,
                                                                          trunk="cpu"))
    return save_plan(plan, tmp_path_factory.mktemp("plan") / "plan.json")


def _edited(plan_file, tmp_path, edit):
    doc = json.loads(plan_file.read_text())
    edit(doc)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(doc))   # NaN / Infinity as the JSON literals a hand edit leaves
    return out


def _refused(path, match):
    from _cli_fixtures import invoke

    from colibri_plan.formats.plan import load_plan

    with pytest.raises(FormatError, match=match):
        load_plan(path)
    for args in (("plan", "show", path), ("export", path, "--to", "llama.cpp")):
        res = invoke(*args)
        lines = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
        assert res.exit_code == 1 and len(lines) == 1 and "Traceback" not in res.output, res.output


def _set(*path_value):
    *path, value = path_value

    def edit(doc):
        node = doc
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return edit


@pytest.mark.parametrize("path", [("predicted", "per_layer_s", 1), ("knobs", "cache_model", "lru_slots_mean"),
                                  ("solver", "trunk", "options", 0, "dense_s"), ("heat", "nan_note")])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_infinity_anywhere_in_a_plan_is_refused_on_load(plan_file, tmp_path, path, value):
    _refused(_edited(plan_file, tmp_path, _set(*path, value)), r"must be a finite number, got (NaN|Infinity)")


@pytest.mark.parametrize("path, value", [
    (("resources", "gpus", 0, "h2d_gbps"), "25"), (("resources", "gpus", 0, "key"), 7),
    (("resources", "gpus", 0, "unified"), "no"), (("resources", "gpus", 0, "matmul_gbps"), -1),
    (("resources", "gpus", 0), "cuda:0"), (("resources", "gpus", 0, "extra"), 1),
    (("resources", "cpu_matmul_gbps"), "20"), (("resources", "ram_read_gbps"), 0),
    (("resources", "disk_queue_depth"), 0.5), (("resources", "page_cache_pool_bytes"), -3),
    (("resources", "disk_depth_gbps"), [[1]]), (("resources", "compute"), [["ram_pinned", 3]]),
    (("resources", "cpu_call_s"), None), (("resources", "gpu_count"), 1),
    (("model", "n_layers"), None), (("model", "top_k"), None), (("predicted", "trunk"), "cpu"),
    (("predicted", "trunk", "kv_bytes"), "big"),
])
def test_malformed_hand_edited_fields_are_refused_on_load(plan_file, tmp_path, path, value):
    _refused(_edited(plan_file, tmp_path, _set(*path, value)), r"plan .*(must be|unknown key|is null)")


@pytest.mark.parametrize("edit, match", [
    (_set("predicted", "hit_rate", "disk", 1.0), "shares sum to 2"),
    (_set("budgets", "kv_bytes", 844_425 * 10**9), "more than the profiled machine's RAM"),
    (_set("budgets", "kv_bytes", 2**62), "more than any machine's memory"),
    (_set("budgets", "trunk_vram_bytes", {"cuda:0": 2**62}), "more than any machine's memory"),
    (_set("predicted", "trunk", "kv_bytes", 2**62), "more than any machine's memory"),
])
def test_contradicting_sizes_are_refused_and_never_exported(plan_file, tmp_path, edit, match):
    from _cli_fixtures import invoke

    path = _edited(plan_file, tmp_path, edit)
    _refused(path, match)
    res = invoke("export", path, "--to", "colibri", "--out", tmp_path / "x.coli_usage")
    assert res.exit_code == 1 and "RAM_GB" not in res.output and not (tmp_path / "x.coli_usage").exists()


def test_a_placement_that_leaves_out_a_moe_layer_is_refused_against_the_model(plan_file, tmp_path):
    from colibri_plan.errors import MismatchError
    from colibri_plan.formats.plan import check_model, load_plan

    def drop_layer_2(doc):
        doc["layers"] = [e for e in doc["layers"] if e["layer"] != 2]
        doc["model"]["moe_layers"] = [1, 3]

    plan = load_plan(_edited(plan_file, tmp_path, drop_layer_2))   # consistent in itself
    check_model(load_plan(plan_file), toy_spec(n_experts=8))
    with pytest.raises(MismatchError, match=r"leaves out MoE layer\(s\) \[2\]"):
        check_model(plan, toy_spec(n_experts=8))


# ---- items 8, 11: stored formats and weights the config leaves unused ---------------------------------

def test_a_pack_index_whose_stored_format_was_edited_fails_model_verify_and_run(tmp_path):
    import dataclasses

    from _cli_fixtures import invoke

    from colibri_plan.engine.fixture import FixtureConfig, build_fixture
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.formats.pack_verify import verify_pack

    cfg = dataclasses.replace(FixtureConfig.small(layers=2, experts=4, top_k=2, hidden=32, width=16,
                                                  vocab=48, head_dim=8), dense_format="int8")
    pack = tmp_path / "fx"
    build_fixture(pack, cfg)
    assert verify_pack(pack)["ok"]
    doc = json.loads((pack / "pack.json").read_text())
    assert doc["format"]["dense_tensors"]["lm_head"] == "int8"
    doc["format"]["dense_tensors"]["lm_head"] = "f32"
    (pack / "pack.json").write_text(json.dumps(doc))
    problems = verify_pack(pack)["problems"]
    assert any("lm_head is stored as I8 but the index says f32" in p for p in problems), problems
    res = invoke("model", "verify", pack)
    assert res.exit_code == 1 and "every checksum matches" not in res.output, res.output
    with pytest.raises(FormatError, match="lm_head.scales but the index stores lm_head as f32"):
        open_pack(pack)


def test_shared_expert_weights_under_a_config_without_shared_experts_are_refused(tmp_path):
    pytest.importorskip("transformers")
    from _tiny_models import build

    from colibri_plan.engine.weights import load_checkpoint

    folder = tmp_path / "glm"
    build("glm4_moe", folder)
    load_checkpoint(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["n_shared_experts"] = 0
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=r"tensor\(s\) config.json leaves unused, e.g. layers.1.shared"):
        load_checkpoint(folder)


# ---- item 12: calibrate on impossible reports ------------------------------------------------------------

def test_calibrate_refuses_a_part_longer_than_its_decode_step():
    from _reports import toy_report

    from colibri_plan.planner.calibrate import fit_coefficients

    good = [toy_report(layers=True), toy_report(cpu=0.1, disk=0.2, layers=True)]
    fit_coefficients(good)
    bad = copy.deepcopy(good[0])
    bad["measured"]["decode_s_per_token"], bad["measured"]["tok_s"] = 0.004, 250.0
    bad["measured"]["terms"].update(dense_s=1.0, expert_compute_s={"cpu": 0.001}, disk_wait_s=0.001,
                                    expert_layers_s=0.002)
    with pytest.raises(FormatError, match=r"measured.dense_s_per_token 1 s is longer than the decode step"):
        fit_coefficients([bad, good[1]], names=["bad.verify.json", "good.verify.json"])


def test_calibrate_refuses_emptied_per_layer_parts():
    from _reports import toy_report

    from colibri_plan.planner.calibrate import fit_coefficients

    rep = toy_report(layers=True)
    rep["predicted"]["cpu_path_layers"] = {k: [] for k in rep["predicted"]["cpu_path_layers"]}
    with pytest.raises(FormatError, match="cpu_path_layers is malformed .*no MoE layer"):
        fit_coefficients([rep])


def test_calibrate_warns_when_a_coefficient_lands_far_from_the_roofline():
    from _reports import toy_report

    from colibri_plan.planner.calibrate import fit_coefficients

    rep = toy_report(layers=True)
    rep["measured"]["terms"]["dense_s"] = 0.9   # inside the 1 s step, but (0.9 - 0.01) / 0.02 = 44.5x
    rep["predicted"]["terms"]["dense_s"] = 0.02
    coef, detail = fit_coefficients([rep])
    assert coef.dense > 20
    assert any("dense" in w and "fitted far from 1" in w for w in detail["warnings"]), detail["warnings"]


# ---- items 9, 15: a routing trace against its counts and the solver's time limit ------------------------

def _traced_heat(tokens: int = 64, seed: int = 0):
    from colibri_plan.formats.heat import Heat
    from colibri_plan.formats.heat_trace import RoutingTrace
    from colibri_plan.heatsynth import sample_trace

    p = np.array([0.30, 0.20, 0.15, 0.10, 0.10, 0.07, 0.05, 0.03])
    rows = [sample_trace(p, tokens, 2, seed + i) for i in range(3)]
    trace = RoutingTrace((1, 2, 3), 2, (8,) + (1,) * (tokens - 8),
                         np.stack(rows).astype(np.int32))
    counts = np.stack([np.bincount(r.ravel(), minlength=8) for r in rows])
    heat = Heat(n_experts=8, layers=(1, 2, 3), counts=counts, top_k=2, tokens=tokens, n_model_layers=4)
    heat.trace = trace
    return heat


def test_a_trace_that_contradicts_the_heat_counts_is_refused(tmp_path):
    from colibri_plan.formats.heat import load_heat, save_heat

    path = save_heat(_traced_heat(), tmp_path / "heat.json")
    assert load_heat(path).trace is not None
    doc = json.loads(path.read_text())
    ids = doc["trace"]["ids"][1]
    doc["trace"]["ids"][1] = [0 if i % 2 == 0 else 1 for i in range(len(ids))]   # routing of another run
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"trace: layer 2 selects expert 0 \d+ times, more than its count"):
        load_heat(path)


def test_a_partial_trace_may_hold_fewer_selections_than_the_counts(tmp_path):
    from colibri_plan.formats.heat import load_heat, save_heat

    heat = _traced_heat()
    heat.counts = heat.counts * 2    # as if the run went on past the trace's size bound
    heat.tokens *= 2
    heat.trace.dropped_steps = 56
    assert load_heat(save_heat(heat, tmp_path / "heat.json")).trace.dropped_steps == 56
    heat.trace.dropped_steps = 0
    with pytest.raises(FormatError, match="no call was dropped, so they must be equal"):
        load_heat(save_heat(heat, tmp_path / "heat2.json"))


def test_the_trace_model_stops_at_the_time_limit_and_says_so(monkeypatch):
    from colibri_plan.planner import make
    from colibri_plan.planner.cache_model import TraceHits, che_hit_rates, lru_hit_rates
    from colibri_plan.planner.options import SolveOptions

    heat = _traced_heat()
    hits = TraceHits(heat.trace, heat.layers, deadline_s=0.0)
    on_disk = np.array([False, False] + [True] * 6)
    p = heat.probabilities()[0]
    assert hits.expired and hits.time_limited
    np.testing.assert_array_equal(lru_hit_rates(p, on_disk, 2, 0, hits),
                                  che_hit_rates(np.where(on_disk, p, 0.0), 2))
    assert not TraceHits(heat.trace, heat.layers, deadline_s=60.0).expired
    prof = toy_profile(ram_available_bytes=8 * 10**9)
    opts = SolveOptions(ram="0.50032", context_tokens=100, trunk="cpu", time_limit_s=5.0)   # 40 KB: LRU
    plan, _, _ = make.make_plan(prof, toy_spec(n_experts=8), heat, opts)
    assert plan.doc["knobs"]["cache_model"]["trace_time_limited"] is False
    monkeypatch.setattr(make, "TraceHits", lambda t, layers, _limit: TraceHits(t, layers, 0.0))
    plan, _, _ = make.make_plan(prof, toy_spec(n_experts=8), heat, opts)
    assert plan.doc["knobs"]["cache_model"]["trace_time_limited"] is True
    assert any("--time-limit 5 s passed" in w for w in plan.doc["heat"]["warnings"]), plan.doc["heat"]


# ---- item 16: grouped routing with fewer eligible experts than top-k -------------------------------------

def test_grouped_routing_that_leaves_fewer_candidates_than_top_k_is_refused(tmp_path):
    from test_fuzz_documents import CONFIGS

    from colibri_plan.families import arch_from_config
    from colibri_plan.formats.arch import ArchConfig

    cfg = dict(CONFIGS["deepseek_v3"])             # 8 experts in 2 groups, top-2 of the best group
    arch = arch_from_config(cfg, where="config.json")
    bad = {**cfg, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}   # 1 group of 2 experts < 3
    with pytest.raises(FormatError, match="leaves 2 eligible experts, fewer than top_k 3"):
        arch_from_config(bad, where="config.json")
    index_arch = {**arch.to_dict(), "n_group": 4, "topk_group": 1, "top_k": 3}   # as an edited pack.json
    with pytest.raises(FormatError, match="leaves 2 eligible experts, fewer than top_k 3"):
        ArchConfig.from_dict(index_arch)


# ---- item 1: long prompts: tiled host attention, a memory pre-check, max_position_embeddings -----------

def test_host_attention_works_in_tiles_with_the_same_numbers(monkeypatch):
    import tracemalloc

    import colibri_plan.backends.reference as ref

    rng = np.random.default_rng(0)
    t, hq, hkv, d = 3000, 4, 2, 16
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    k, v = (rng.standard_normal((t, hkv, d)).astype(np.float32) for _ in range(2))
    whole = ref._attention_tile(q, k, v, t, 0, 0.25, 0)          # one pass: [2, 2, 3000, 3000] float64
    tracemalloc.start()
    tiled = ref.attention_ref(q, k, v, t, 0, 0.25, 0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    np.testing.assert_array_equal(tiled, whole)
    # a tile's scores, masked scores and exponentials; one pass would hold 3 x 288 MB of them
    assert peak < 4 * ref.ATTENTION_TILE_BYTES < 8 * hq * t * t, peak
    monkeypatch.setattr(ref, "ATTENTION_TILE_BYTES", 8 * hq * t * 5)   # 5-row tiles, a sliding window
    np.testing.assert_array_equal(ref.attention_ref(q[:40], k, v, 140, 100, 0.25, 7),
                                  ref._attention_tile(q[:40], k, v, 140, 100, 0.25, 7))


def test_the_prefill_memory_estimate_and_its_refusal():
    from colibri_plan.engine.prompt_limits import check_prefill_memory, prefill_host_bytes
    from colibri_plan.errors import BudgetError
    from colibri_plan.formats.arch import ArchConfig

    arch = ArchConfig(family="mixtral", vocab_size=100, hidden_size=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=16, n_experts=4, top_k=2, moe_intermediate_size=32,
                      moe_layers=(0, 1), max_position_embeddings=64)
    need = prefill_host_bytes(arch, 20_000, 20_008)
    assert need["kv_bytes"] == 2 * 2 * 16 * 4 * 20_008 * 2                 # K and V, float32, 2 layers
    assert need["activation_bytes"] == 20_000 * (3 * 64 + 2 * 64 + 2 * 32 + 3 * 32 + 4 + 4 * 64) * 4
    check_prefill_memory(arch, 20_000, 20_008, available=need["total_bytes"])
    with pytest.raises(BudgetError, match=r"prefill of a 20,000-token prompt needs about 0\.2\d GB"):
        check_prefill_memory(arch, 20_000, 20_008, available=need["total_bytes"] - 1)


def test_a_prompt_beyond_max_position_embeddings_is_refused_before_the_prefill(tmp_path):
    from _cli_fixtures import invoke

    from colibri_plan.engine.fixture import FixtureConfig, build_fixture

    pack = tmp_path / "fx"
    build_fixture(pack, FixtureConfig.small(layers=2, experts=4, top_k=2, hidden=32, width=16, vocab=48,
                                            head_dim=8))
    ok = invoke("run", "--model", pack, "--prompt-ids", ",".join(["1"] * 10), "--tokens", "2",
                "--backend", "numpy")
    assert ok.exit_code == 0, ok.output
    doc = json.loads((pack / "pack.json").read_text())
    doc["arch"]["max_position_embeddings"] = 8
    (pack / "pack.json").write_text(json.dumps(doc))
    res = invoke("run", "--model", pack, "--prompt-ids", ",".join(["1"] * 10), "--tokens", "2",
                 "--backend", "numpy")
    lines = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert res.exit_code == 1 and len(lines) == 1, res.output
    assert "needs 12 positions, beyond the model's max_position_embeddings 8" in lines[0]
    assert "tok/s" not in res.output


# ---- item 17 (rest): profile --quick --model PACK measures the pack's own format first -------------------

def test_the_models_expert_format_is_profiled_first(tmp_path):
    import dataclasses

    from colibri_plan.engine.fixture import FixtureConfig, build_fixture
    from colibri_plan.profiler.options import ProfileOptions
    from colibri_plan.profiler.run import run_profile

    pack = tmp_path / "fx"
    cfg = FixtureConfig.small(layers=2, experts=4, top_k=2, hidden=32, width=16, vocab=48, head_dim=8)
    build_fixture(pack, dataclasses.replace(cfg, quant="int8"))
    fmt = json.loads((pack / "pack.json").read_text())["format"]["expert_format"]
    assert fmt not in ("int4", "int4-g64")   # the default formats, which used to come first
    prof = run_profile(ProfileOptions(model=str(pack), quick=True, probes=("ram",), ram_bytes=1 << 20))
    # a quick mode's per-device budget that runs out skips the last formats: the pack's is never last
    assert prof.doc["settings"]["formats"] == [fmt, "int4", "int4-g64"]
