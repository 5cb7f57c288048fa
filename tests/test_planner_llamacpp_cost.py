"""planner/llamacpp_cost: llama.cpp priced as it runs, on toy numbers checkable by hand.

The toy model: 2 MoE layers of 4 experts (top-2), each expert 3 MB (1 MB per projection), 1 MB of dense
tensors per layer, a 1 MB head, no KV and no compute buffers (vocab = hidden = 0). The toy machine: CPU
1 GB/s (10 batched), GPU 10 GB/s (100 batched), page faults 0.5 GB/s, host-to-device 1 GB/s.
"""

from __future__ import annotations

import dataclasses

import pytest

from colibri_plan.errors import InputError
from colibri_plan.planner.llamacpp_calibrate import fit, host_projections
from colibri_plan.planner.llamacpp_cost import (
    LlamaCoefficients,
    LlamaGeometry,
    LlamaMachine,
    LlamaPlacement,
    check_placement,
    decode_seconds,
    memory,
    predict,
    raw_terms,
)

MB = 1_000_000
G = LlamaGeometry(n_layers=2, moe=(True, True), n_experts=4, top_k=2, expert_bytes=3 * MB,
                  layer_dense_bytes=1 * MB, head_bytes=1 * MB, kv_bytes_per_token_layer=0, hidden_size=0,
                  vocab_size=0)
M = LlamaMachine(cpu_gbps=1.0, cpu_batch_gbps=10.0, fault_gbps=0.5, gpu_gbps=10.0, gpu_batch_gbps=100.0,
                 h2d_gbps=1.0, ram_limit_bytes=0, vram_bytes=100 * MB)
ONE = LlamaCoefficients()


def test_cpu_only_reads_dense_head_and_top_k_experts_per_token():
    t = raw_terms(G, M, LlamaPlacement(ngl=0, context=512, ubatch=512))
    # 2 MB dense + 1 MB head + 2 layers x 2 experts x 3 MB = 15 MB at 1 GB/s = 15 ms
    assert t["cpu_s"] == pytest.approx(15e-3)
    assert t["gpu_s"] == 0 and t["fault_s"] == 0 and t["splits"] == 0
    assert decode_seconds(t, ONE) == pytest.approx(15e-3)
    # prefill: the same 15 MB per token at 10 GB/s batched = 1.5 ms, no GPU to offload to
    assert t["pp_cpu_s"] == pytest.approx(1.5e-3) and t["xfer_s"] == 0
    assert t["pp_graph"] == pytest.approx(1 / 512)


def test_ngl_counts_the_head_as_the_last_layer():
    pl = LlamaPlacement(ngl=1)
    assert pl.on_gpu(2, 2) and not pl.on_gpu(1, 2)            # -ngl 1: the output head alone
    assert LlamaPlacement(ngl=3).on_gpu(0, 2)                  # n_layers + 1: everything
    assert memory(G, LlamaPlacement(ngl=1))["gpu_model"] == 1 * MB


def test_experts_overridden_to_cpu_on_a_gpu_layer_cost_two_splits_and_a_copy_per_micro_batch():
    pl = LlamaPlacement(ngl=3, cpu_experts={1: ("gate", "up", "down")}, context=512, ubatch=512)
    t = raw_terms(G, M, pl)
    # GPU: 2 MB dense + 1 MB head + layer 0's 2 x 3 MB = 9 MB at 10 GB/s; CPU: layer 1's 6 MB at 1 GB/s
    assert t["gpu_s"] == pytest.approx(0.9e-3)
    assert t["cpu_s"] == pytest.approx(6e-3)
    assert t["splits"] == 2                                    # into the CPU experts of layer 1 and back
    # prefill: the host expert tensor (4 x 3 MB) crosses once per 512-token micro-batch at 1 GB/s and is
    # computed on the GPU: 15 MB per token at 100 GB/s
    assert t["xfer_s"] == pytest.approx(12e-3 / 512)
    assert t["pp_gpu_s"] == pytest.approx(0.15e-3) and t["pp_cpu_s"] == 0
    c = dataclasses.replace(ONE, split_s=1e-4, graph_s=2e-4)
    assert decode_seconds(t, c) == pytest.approx(0.9e-3 + 6e-3 + 2e-4 + 2e-4)


def test_prefill_offloads_the_dense_weights_of_cpu_layers_too():
    # -ngl 2: layer 1 and the head on the GPU, layer 0 (1 MB dense + its 12 MB expert tensors) on the host.
    # A 512-token micro-batch copies every host weight (13 MB) to the GPU once and computes it there, as
    # llama.cpp's scheduler offloads any op whose weight sits in a host buffer (KV is 0 here: nothing of
    # layer 0 is left for the CPU)
    pl = LlamaPlacement(ngl=2, context=512, ubatch=512)
    t = raw_terms(G, M, pl)
    assert t["cpu_s"] == pytest.approx(7e-3)                   # decode: 1 MB dense + 2 x 3 MB experts
    assert t["xfer_s"] == pytest.approx(13e-3 / 512)
    assert t["pp_cpu_s"] == 0
    assert t["pp_gpu_s"] == pytest.approx(15e-3 / 100e9 * 1e9)  # all 15 MB a token reads, on the GPU
    # a micro-batch below 32 tokens is not offloaded: the CPU computes layer 0's 7 MB per token
    t = raw_terms(G, M, dataclasses.replace(pl, ubatch=16))
    assert t["xfer_s"] == 0 and t["pp_cpu_s"] == pytest.approx(7e-3 / 10)


def test_down_projection_apart_splits_a_layer_between_cpu_and_gpu():
    pl = LlamaPlacement(ngl=3, cpu_experts={0: ("down",)})
    t = raw_terms(G, M, pl)
    # layer 0: 2 experts x 1 MB of down on the CPU; the rest (2 + 1 + 4 + 6 MB) on the GPU
    assert t["cpu_s"] == pytest.approx(2e-3)
    assert t["gpu_s"] == pytest.approx(13e-3 / 10)
    assert memory(G, pl)["host_model"] == 4 * MB               # the down tensor of 4 experts


def test_mmap_beyond_the_ram_limit_faults_in_the_page_cache_misses():
    # 15 MB limit: 3 MB of dense and head stay cached, 12 MB = 4 of the 8 (layer, expert) items fit;
    # equal heat -> each hit with probability 1/2 (Che at equal popularity): 12 MB read, half missed
    m = dataclasses.replace(M, ram_limit_bytes=15 * MB)
    t = raw_terms(G, m, LlamaPlacement(ngl=0))
    assert t["fault_bytes"] == pytest.approx(6 * MB, rel=1e-6)
    assert t["fault_s"] == pytest.approx(12e-3, rel=1e-6)
    assert raw_terms(G, dataclasses.replace(M, ram_limit_bytes=27 * MB), LlamaPlacement())["fault_s"] == 0
    # --no-mmap cannot hold the 15 MB of host weights in 15 MB with its buffers ... it can (no buffers),
    # but not in 14 MB; mlock pins the mapped pages: no faults when it fits
    assert check_placement(G, dataclasses.replace(m, ram_limit_bytes=14 * MB),
                           LlamaPlacement(load="no-mmap")) is not None
    assert raw_terms(G, dataclasses.replace(m, ram_limit_bytes=27 * MB),
                     LlamaPlacement(load="mlock"))["fault_s"] == 0


def test_gpu_buffers_over_the_vram_budget_are_refused():
    m = dataclasses.replace(M, vram_bytes=8 * MB)
    why = check_placement(G, m, LlamaPlacement(ngl=3))         # 2 + 1 + 24 MB on the GPU
    assert why is not None and "exceed the VRAM budget" in why
    assert check_placement(G, m, LlamaPlacement(ngl=3, cpu_experts={0: ("gate", "up", "down"),
                                                                   1: ("gate", "up", "down")})) is None
    assert predict(G, m, LlamaPlacement(ngl=3), ONE)["infeasible"] == why


def test_no_repack_of_a_repacked_quant_adds_its_cpu_seconds_once():
    g = dataclasses.replace(G, repackable=True)
    t = raw_terms(g, M, LlamaPlacement(ngl=0, repack=False))
    assert t["norepack_s"] == pytest.approx(15e-3) and t["pp_norepack_s"] == pytest.approx(1.5e-3)
    assert raw_terms(G, M, LlamaPlacement(ngl=0, repack=False))["norepack_s"] == 0   # not repacked anyway
    c = dataclasses.replace(ONE, c_norepack=0.5)
    assert decode_seconds(t, c) == pytest.approx(15e-3 * 1.5)


def test_two_gpus_pool_their_vram_with_a_compute_buffer_each_and_one_more_split():
    g = dataclasses.replace(G, vocab_size=1000)               # compute buffer 4 B x 512 x 1000 = 2.048 MB
    pl = LlamaPlacement(ngl=3, context=512, ubatch=512)
    one = dataclasses.replace(M, vram_bytes=30 * MB)
    two = dataclasses.replace(M, vram_bytes=30 * MB, n_gpus=2)
    assert memory(g, pl)["gpu_total"] == 27 * MB + 2_048_000   # 2 + 1 + 24 MB of weights
    assert check_placement(g, one, pl) is None
    assert check_placement(g, two, pl) is not None            # + a second 2.048 MB buffer > 30 MB
    big = dataclasses.replace(two, vram_bytes=40 * MB)
    assert raw_terms(g, big, pl)["splits"] == raw_terms(g, one, pl)["splits"] + 1


def test_heat_of_another_shape_is_refused():
    import numpy as np

    with pytest.raises(InputError, match=r"heat of shape \(3, 4\)"):
        raw_terms(G, M, LlamaPlacement(), np.full((3, 4), 0.5))


def test_ot_patterns_match_llama_cpp_tensor_names_first_match_wins():
    assert host_projections([r"blk\.(0|1)\.ffn_(gate|up|down)_exps=CPU"], 3) == \
        {0: ("gate", "up", "down"), 1: ("gate", "up", "down")}
    assert host_projections([r"\.ffn_down_exps=CPU"], 2) == {0: ("down",), 1: ("down",)}
    assert host_projections([r"blk\.0\.ffn_down_exps=CUDA0", r"\.ffn_down_exps=CPU"], 2) == {1: ("down",)}
    assert host_projections([], 3, n_cpu_moe=1) == {0: ("gate", "up", "down")}
    assert len(host_projections([], 3, cpu_moe=True)) == 3
    with pytest.raises(InputError, match="PATTERN=BUFFER"):
        host_projections(["blk.0"], 2)


def test_fit_recovers_known_coefficients_from_exact_rows():
    true = LlamaCoefficients(c_cpu=0.6, c_gpu=1.5, c_fault=3.0, split_s=2e-4, graph_s=1e-3, c_pp_cpu=0.8,
                             c_pp_gpu=1.2, c_xfer=2.0)
    m = dataclasses.replace(M, ram_limit_bytes=15 * MB)
    pls = [LlamaPlacement(ngl=0), LlamaPlacement(ngl=3, cpu_experts={1: ("gate", "up", "down")}),
           LlamaPlacement(ngl=3, cpu_experts={0: ("down",)}), LlamaPlacement(ngl=2),
           LlamaPlacement(ngl=1, ubatch=64), LlamaPlacement(ngl=3, cpu_experts={0: ("gate",), 1: ("up",)})]
    # one model reads the same bytes per token wherever they are: a second one (3 layers) tells the
    # fixed per-token cost from the per-byte ones
    g3 = dataclasses.replace(G, n_layers=3, moe=(True, True, True))
    pls += [LlamaPlacement(ngl=4), LlamaPlacement(ngl=0, ubatch=128)]
    rows = []
    for i, pl in enumerate(pls):
        mm = m if i != 3 else M                                # one row without page faults
        t = raw_terms(G if i < 6 else g3, mm, pl)
        from colibri_plan.planner.llamacpp_cost import prefill_seconds

        rows.append({"file": "toy", "placement": str(i), "terms": t, "decode_s": decode_seconds(t, true),
                     "prefill_s": prefill_seconds(t, true)})
    coef, detail = fit(rows, ["toy rows"])
    for k in ("c_cpu", "c_gpu", "c_fault", "split_s", "graph_s", "c_pp_cpu", "c_pp_gpu", "c_xfer"):
        assert getattr(coef, k) == pytest.approx(getattr(true, k), rel=1e-6), k
    assert detail["max_rel_error"]["decode"] == pytest.approx(0, abs=1e-9)
    assert coef.calibrated_on == "toy rows" and ONE.calibrated_on == "uncalibrated"
