"""bench/replay_gpu.py and bench/qwen3_numpy.py without llama.cpp or a GPU: the sizing search, the
projection's GPU rows, the sized placements (a stub projection), the numpy checkpoint against
transformers' loader."""

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import qwen3_numpy as q3  # noqa: E402
import replay_gpu as rg  # noqa: E402


def test_fewest_that_fit_is_the_first_k_from_which_it_fits():
    assert rg.fewest_that_fit(lambda k: k, 0, 10, lambda k: k >= 7) == 7
    assert rg.fewest_that_fit(lambda k: k, 0, 10, lambda k: True) == 0
    assert rg.fewest_that_fit(lambda k: k, 0, 10, lambda k: False) == 10  # none: the top of the range


def test_gpu_projection_counts_gpu_devices_only():
    rows = [
        {"device": "CUDA0", "model_mib": 2000, "context_mib": 50, "compute_mib": 300},
        {"device": "Host", "model_mib": 9000, "context_mib": 1, "compute_mib": 20},
    ]
    assert rg.gpu_projection_mib(rows) == 2350


def test_sized_placements_fit_the_budget_by_the_projection(monkeypatch):
    # a stub of llama.cpp's projection: 100 MiB per whole layer on the GPU (4 layers + output of 100), an
    # expert tensor set 60 of it (gate/up 40, down 20)
    def proj(a, gguf, p, ctx):
        n = 4
        ngl = n + 1 if p.ngl is None else p.ngl
        mib = 100 * ngl
        gate_up_cpu = (
            len(p.overrides[1].split("(")[1].split(")")[0].split("|")) if len(p.overrides) > 1 else 0
        )
        for lay in range(n + 1 - ngl, n):  # the GPU layers' experts
            if p.cpu_moe or (p.n_cpu_moe is not None and lay < p.n_cpu_moe):
                mib -= 60
            elif p.overrides:  # the down split: every down on the CPU
                mib -= 20 + (40 if lay < gate_up_cpu else 0)
        return mib, []

    monkeypatch.setattr(rg, "projection", proj)
    got = rg.sized_placements(argparse.Namespace(), Path("m.gguf"), 4, 576, 300.0, None, None)
    names = {p.name: mib for p, mib in got}
    assert names["all-gpu"] == 500  # the over-budget reference
    assert names["ngl-3"] == 300 and names["ngl-1"] == 100  # the most whole layers, and half
    assert names["n-cpu-moe-4"] == 260  # 3 layers' experts off: 320 > 300
    assert names["cpu-moe"] == 260
    split = next(p for p, _ in got if p.name.startswith("down-split"))
    assert split.name == "down-split-3" and names["down-split-3"] == 300  # 500 - 4 x 20 - 3 x 40
    assert split.overrides == [r"\.ffn_down_exps=CPU", r"blk\.(0|1|2)\.ffn_(up|gate)_exps=CPU"]
    assert all(mib <= 300 for p, mib in got if p.name != "all-gpu")


def test_numpy_checkpoint_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    sizes = {
        **q3.H200_SIZES,
        "num_hidden_layers": 2,
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "hidden_size": 64,
        "vocab_size": 300,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts_per_tok": 2,
    }
    q3.build(tmp_path / "ck", sizes, seed=3, threads=2)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ck"), dtype=torch.float32)
    w = m.model.layers[1].self_attn.q_proj.weight.detach().numpy()
    assert w.shape == (64, 64) and 0.015 < float(w.std()) < 0.025
    assert np.all(m.model.norm.weight.detach().numpy() == 1)
    q3.build(tmp_path / "ck2", sizes, seed=3, threads=1)  # the same for a seed, any threads
    assert (tmp_path / "ck" / "model-00002-of-00003.safetensors").read_bytes() == (
        tmp_path / "ck2" / "model-00002-of-00003.safetensors"
    ).read_bytes()


def test_a_placements_ubatch_goes_to_both_spellings_once():
    import replay_llama as ll

    p = ll.Placement("pick", "a pick", ngl=25, overrides=[r"blk\.(1|2)\.ffn_(gate|up|down)_exps=CPU"],
                     ubatch=1024)
    assert p.bench_args()[-2:] == ["-ub", "1024"] and p.common_args()[-2:] == ["-ub", "1024"]
    argv = ll.bench_argv(Path("bin"), Path("m.gguf"), p, 16, 512, 64, 512)
    assert argv.count("-ub") == 1 and argv[argv.index("-ub") + 1] == "1024"   # not the replay's 512
    plain = ll.bench_argv(Path("bin"), Path("m.gguf"), ll.Placement("x", "x"), 16, 512, 64, 512)
    assert plain[plain.index("-ub") + 1] == "512"
    assert p.to_dict()["ubatch"] == 1024


def test_the_context_probe_reads_the_gpu_rows_unaccounted_mib(monkeypatch):
    at_exit = [{"name": "CUDA0 (H200)", "self_mib": 680, "unaccounted_mib": 597},
               {"name": "Host", "self_mib": 4212}]
    seen = {}

    def memory(a, gguf, p, ctx):
        seen["p"] = p
        return {"completion": {"breakdown": {"at_exit": at_exit}}}

    monkeypatch.setattr(rg, "memory", memory)
    assert rg.context_probe_mib(argparse.Namespace(), Path("m.gguf"), 576) == 597.0
    assert seen["p"].cpu_moe                                      # a small run: every expert on the CPU
    at_exit[0]["unaccounted_mib"] = -1278                         # a projection's negative: no context
    assert rg.context_probe_mib(argparse.Namespace(), Path("m.gguf"), 576) == 0.0


def test_fit_at_the_same_self_bytes_leaves_the_context_out_of_its_margin(monkeypatch):
    calls = []

    class R:
        returncode, stderr = 0, ""
        stdout = '-c 576 -ngl 25 -ot "blk\\.9\\.ffn_(up|down|gate_up|gate)_(ch|)exps=CPU"'

    monkeypatch.setattr(rg, "run", lambda argv, timeout_s=600.0: calls.append(argv) or R())
    a = argparse.Namespace(llama_bin="bin", threads=None)
    doc: dict = {}
    p = rg.fit_at_vram(a, Path("m.gguf"), 2384.2, 143156, 576, doc, context_mib=597.0)
    d = rg.fit_at_vram(a, Path("m.gguf"), 2384.2, 143156, 576, doc, name="fit-device", key="fit_device")
    assert calls[0][calls[0].index("-fitt") + 1] == str(int(143156 - 2384.2 - 597))   # 140174
    assert calls[1][calls[1].index("-fitt") + 1] == str(int(143156 - 2384.2))
    assert (p.name, d.name) == ("fit", "fit-device") and p.ngl == 25 and d.overrides == p.overrides
    assert doc["fit"]["context_mib_subtracted"] == 597.0 and doc["fit_device"]["margin_mib"] == 140771


def test_a_pick_is_replayed_with_its_ub_and_an_abstain_is_not(monkeypatch):
    import replay_ours as ro

    ot = r"blk\.(11|12)\.ffn_(gate|up|down)_exps=CPU"
    docs = {"use.json": {"verdict": "use", "ngl": 25, "patterns": [ot],
                         "args": f'-ngl 25 -ot "{ot}" -c 576 -ub 1024 -t 16'},
            "keep.json": {"verdict": "keep --fit", "args": "", "patterns": [], "ngl": 25,
                          "choice": {"why": "within the noise"}}}
    monkeypatch.setattr(ro, "export_llama", lambda cli, plan: docs[plan.name])
    a, doc = argparse.Namespace(plan=None, colibri="cp"), {}
    p = rg.export_placement(a, doc, "use.json", "pick")
    assert (p.name, p.ngl, p.ubatch) == ("pick", 25, 1024) and p.overrides == docs["use.json"]["patterns"]
    assert doc["ours"]["pick"]["plan"] == "use.json"
    assert rg.export_placement(a, doc, "keep.json", "pick") is None
    assert rg.export_placement(a, doc) is None                  # no --plan: no export row
