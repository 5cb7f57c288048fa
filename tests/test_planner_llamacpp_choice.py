"""planner/llamacpp_choice, llamacpp_compare and the export hook: the llama.cpp pick, by hand.

Toy model and machine as tests/test_planner_llamacpp_cost.py (2 MoE layers of 4 x 3 MB experts, top-2,
1 MB of dense per layer, a 1 MB head; CPU 1 GB/s, GPU 10 GB/s) with an 8 MB VRAM budget: the dense
tensors and the head (3 MB) fit, no whole expert layer (12 MB) does, one layer's down tensor (4 MB) does.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from colibri_plan.errors import FormatError
from colibri_plan.planner.llamacpp_choice import candidates, choose, export_hook, fit_placement, llama_args
from colibri_plan.planner.llamacpp_cost import LlamaGeometry, LlamaMachine, LlamaPlacement, memory

MB = 1_000_000
G = LlamaGeometry(n_layers=2, moe=(True, True), n_experts=4, top_k=2, expert_bytes=3 * MB,
                  layer_dense_bytes=1 * MB, head_bytes=1 * MB, kv_bytes_per_token_layer=0, hidden_size=0,
                  vocab_size=0)
M = LlamaMachine(cpu_gbps=1.0, cpu_batch_gbps=10.0, fault_gbps=0.5, gpu_gbps=10.0, gpu_batch_gbps=100.0,
                 h2d_gbps=1.0, ram_limit_bytes=0, vram_bytes=8 * MB)
BASE = LlamaPlacement(context=512, ubatch=512, threads=2)


def test_fit_puts_every_dense_tensor_on_the_gpu_and_no_expert_layer_that_does_not_fit():
    fit = fit_placement(G, M, BASE)
    assert fit.ngl == 3 and set(fit.cpu_experts) == {0, 1}
    assert memory(G, fit)["gpu_total"] == 3 * MB


def test_the_pick_moves_one_down_tensor_beside_the_run_and_beats_fit_by_hand():
    c = choose(G, M, BASE)
    # --fit: 3 MB on the GPU (0.3 ms) + 12 MB of experts on the CPU (12 ms) = 12.3 ms -> 81.3 tok/s;
    # the pick adds layer 0's down (2 selected x 1 MB) to the GPU: 0.5 ms + 10 ms = 10.5 ms -> 95.2 tok/s
    assert c["fit"]["decode_tok_s"] == pytest.approx(1 / 12.3e-3)
    assert c["chosen"]["decode_tok_s"] == pytest.approx(1 / 10.5e-3)
    assert c["verdict"] == "use" and "+17%" in c["why"]
    assert r"blk\.(0)\.ffn_(gate|up)_exps=CPU" in c["chosen"]["args"]
    assert r"blk\.(1)\.ffn_(gate|up|down)_exps=CPU" in c["chosen"]["args"]


def test_every_candidate_fits_the_vram_in_llama_cpps_accounting():
    cands = list(candidates(G, M, BASE))
    assert len(cands) >= 4
    assert all(memory(G, pl)["gpu_total"] <= M.vram_bytes for pl in cands)
    tight = dataclasses.replace(M, vram_bytes=2 * MB)     # not even the dense tensors of both layers
    assert all(memory(G, pl)["gpu_total"] <= 2 * MB for pl in candidates(G, tight, BASE))


def test_within_noise_of_fit_the_answer_is_keep_fit_with_the_figures():
    roomy = dataclasses.replace(M, vram_bytes=100 * MB)   # everything fits: fit is already all-GPU
    c = choose(G, roomy, BASE)
    assert c["verdict"] == "keep --fit" and "within the 5% noise" in c["why"] and "+0%" in c["why"]
    cpu = choose(G, dataclasses.replace(M, gpu_gbps=0.0, vram_bytes=0), BASE)
    assert cpu["fit"] is None and cpu["chosen"]["args"][:2] == ["-ngl", "0"]


def test_args_spell_kv_ubatch_and_load_mode():
    pl = LlamaPlacement(ngl=3, cpu_experts={1: ("down",)}, kv_on_gpu=False, context=80, ubatch=256,
                        threads=2, load="no-mmap")
    assert llama_args(pl, 2) == ["-ngl", "3", "-ot", r"blk\.(1)\.ffn_down_exps=CPU", "-nkvo", "-c", "80",
                                 "-ub", "256", "-t", "2", "--no-mmap"]


def test_export_hook_uses_the_pick_or_says_keep_fit_and_refuses_a_bad_section():
    c = choose(G, M, BASE)
    out = export_hook({"args": "-ot x", "patterns": ["x"], "notes": ["n"]}, c)
    assert out["verdict"] == "use" and out["args"].startswith("-ngl 3 -ot ") and len(out["patterns"]) == 2
    assert out["approximation"]["args"] == "-ot x"
    keep = choose(G, dataclasses.replace(M, vram_bytes=100 * MB), BASE)
    out = export_hook({"args": "-ot x", "notes": []}, keep)
    assert out["args"] == "" and out["notes"][0].startswith("keep --fit")
    with pytest.raises(FormatError, match="llamacpp must be"):
        export_hook({}, {"verdict": "maybe"})
    json.dumps(out)                                        # the export's --json document


def test_solve_target_llama_cpp_writes_the_section_and_compare_prices_fit_as_llama_cpp():
    from _solver_fixtures import toy_profile, toy_spec

    from colibri_plan.planner.compare import compare_placements
    from colibri_plan.planner.llamacpp_inputs import section
    from colibri_plan.planner.make import make_plan
    from colibri_plan.planner.options import SolveOptions

    prof = toy_profile(gpus=[{"gbps": 200.0, "free_bytes": 3 * 10**9}], ram_available_bytes=8 * 10**9)
    spec = toy_spec(n_layers=8, moe_layers=range(8), n_experts=64, inter=512, hidden=512, vocab=4096,
                    dense_params=8_000_000)
    plan, sol, setup = make_plan(prof, spec, None, SolveOptions(ram="1", vram="0.05", vram_reserve_gb=0.0,
                                                                 context_tokens=256, trunk="cpu",
                                                                 target="llama.cpp"))
    assert plan.doc["knobs"]["target"] == "llama.cpp"
    sec = section(setup, prof)
    assert sec["budgets"]["vram_bytes"] == 50_000_000 and sec["calibrated_on"] == "uncalibrated"
    assert sec["chosen"]["memory"]["gpu_total"] <= sec["budgets"]["vram_bytes"]
    rows = compare_placements(setup, sol, host_copy_toggle=False, llama=sec)
    fit = next(r for r in rows if r["placement"] == "llama.cpp --fit layers")
    assert fit["tok_s"] == pytest.approx(sec["fit"]["decode_tok_s"])
    assert fit["calibrated_on"] == "uncalibrated" and fit["llama_args"] == sec["fit"]["args"]
    assert all("calibrated_on" in r for r in rows)


def test_without_a_gpu_the_reference_is_llama_cpps_defaults():
    cpu_m = dataclasses.replace(M, gpu_gbps=0.0, vram_bytes=0)
    c = choose(G, cpu_m, BASE)
    # nothing to place and RAM unlimited: every CPU placement costs the defaults' 15 ms (2 x 2 selected
    # 3 MB experts, 2 MB of dense and the 1 MB head at 1 GB/s) -> keep --fit, with the defaults' figures
    assert c["fit"] is None and c["verdict"] == "keep --fit"
    assert "nothing to place" in c["why"] and "+0%" in c["why"] and "llama.cpp's defaults" in c["why"]
    assert c["chosen"]["decode_tok_s"] == pytest.approx(1 / 15e-3)
    out = export_hook({"args": "-ngl 0", "notes": []}, c)
    assert out["args"] == "" and out["notes"][0].startswith("keep --fit")
