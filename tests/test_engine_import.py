"""Checkpoint import, architecture reading, the DeepSeek router/MoE block and the engine's error paths."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from colibri_plan.engine.forward import Model
from colibri_plan.engine.moe import RamExperts, RoutingRecorder, route, routed_experts
from colibri_plan.engine.weights import InMemoryWeights, load_checkpoint
from colibri_plan.errors import FormatError, InputError, UnsupportedError
from colibri_plan.families import arch_from_config
from colibri_plan.formats.arch import ArchConfig
from colibri_plan.quant import dequantize


def _torch():
    pytest.importorskip("torch", reason="torch builds the reference models")
    pytest.importorskip("transformers", minversion="5.0", reason="transformers >= 5 builds the references")
    import torch
    import transformers
    return torch, transformers


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    _torch()
    from _tiny_models import build
    folder = tmp_path_factory.mktemp("olmoe")
    build("olmoe", folder, seed=3)
    return folder


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_arch_round_trips_and_validates(olmoe_dir):
    arch = arch_from_config(json.loads((olmoe_dir / "config.json").read_text()))
    assert (arch.qk_norm, arch.clip_qkv, arch.moe_layers, arch.n_experts) == ("full", 2.0, (0, 1), 8)
    assert ArchConfig.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch
    bad = dict(arch.to_dict(), n_kv_heads=3)
    with pytest.raises(FormatError, match="multiple of n_kv_heads"):
        ArchConfig.from_dict(bad)
    with pytest.raises(FormatError, match="missing fields"):
        ArchConfig.from_dict({"family": "x"})


def test_unsupported_family_and_rope_named():
    with pytest.raises(UnsupportedError, match="'llama'"):
        arch_from_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    cfg = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 10, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 8,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 4}}
    with pytest.raises(UnsupportedError, match="llama3"):
        arch_from_config(cfg)


def test_deepseek_v32_checkpoint_rejected_naming_the_dsa_indexer(tmp_path):
    torch, tf = _torch()
    cfg = tf.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                              n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    torch.manual_seed(0)
    tf.DeepseekV3ForCausalLM(cfg).save_pretrained(str(tmp_path))
    assert load_checkpoint(tmp_path).arch.attention == "mla"  # MLA runs (tests/test_engine_mla.py)
    config = {**json.loads((tmp_path / "config.json").read_text()), "model_type": "deepseek_v32",
              "index_topk": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="index_topk"):
        load_checkpoint(tmp_path)
    arch = arch_from_config(config, plan_only=True)
    assert (arch.attention, arch.moe_layers, arch.scoring, arch.n_group) == ("mla", (1,), "sigmoid", 2)


class _Experts:
    """ModelWeights-like expert source for RamExperts (fused transformers expert tensors)."""

    def __init__(self, arch, gate_up, down):
        self.arch, self.gate_up, self.down = arch, gate_up, down

    def expert_keys(self):
        return [(self.arch.moe_layers[0], e) for e in range(self.arch.n_experts)]

    def expert(self, layer, e):
        from colibri_plan.quant import quantize
        i = self.arch.moe_intermediate_size
        return (quantize(self.gate_up[e][:i], "f32"), quantize(self.gate_up[e][i:], "f32"),
                quantize(self.down[e], "f32"))


def _swiglu(x, gate, up, down):
    """The shared experts' SwiGLU through the numpy backend's device ops (what the trunk runs)."""
    from colibri_plan.backends import get_backend
    from colibri_plan.quant import quantize

    be = get_backend("numpy").open(0)
    try:
        g, u = be.d_matmul_many(be.d_put(x), [be.upload(quantize(m, "f32")) for m in (gate, up)])
        return be.d_get(be.d_matmul(be.d_silu_mul(g, u), be.upload(quantize(down, "f32"))))
    finally:
        be.close()


@pytest.mark.parametrize("version", ["v3", "v2"])
def test_deepseek_moe_block_matches_transformers(version):
    """Router (sigmoid + bias + groups, or softmax + group max) and the whole MoE block with shared
    experts (the engine's routed experts + the shared SwiGLU on device ops, summed as the trunk does),
    against DeepseekV3MoE / DeepseekV2Moe on random inputs."""
    torch, tf = _torch()
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              num_hidden_layers=2, num_attention_heads=2, n_shared_experts=2, num_experts_per_tok=3,
              n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1)
    if version == "v3":
        cfg = tf.DeepseekV3Config(**kw, n_routed_experts=16, norm_topk_prob=True)
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block
    else:
        cfg = tf.DeepseekV2Config(**kw, n_routed_experts=16, topk_method="group_limited_greedy")
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as Block
    torch.manual_seed(1)
    block = Block(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        if version == "v3":
            block.gate.e_score_correction_bias.normal_(0, 0.2)
    arch = arch_from_config(cfg.to_dict(), plan_only=True)
    assert arch.group_score == ("top2_sum" if version == "v3" else "max")
    x = torch.randn(1, 24, 32)
    with torch.no_grad():
        _, w_ref, ids_ref = block.gate(x)
        y_ref = block(x)[0].numpy()
    g = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    layer = arch.moe_layers[0]
    dense = {f"layers.{layer}.router": g["gate.weight"],
             **{f"layers.{layer}.shared.{r}": g[f"shared_experts.{r}_proj.weight"]
                for r in ("gate", "up", "down")}}
    bias = g.get("gate.e_score_correction_bias")
    if bias is not None:
        dense[f"layers.{layer}.router_bias"] = bias
    ids, w = route(x[0].numpy() @ dense[f"layers.{layer}.router"].T, arch, bias)
    order = np.argsort(ids_ref.numpy(), axis=1)
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.take_along_axis(ids_ref.numpy(), order, 1))
    np.testing.assert_allclose(np.take_along_axis(w, np.argsort(ids, axis=1), 1),
                               np.take_along_axis(w_ref.numpy(), order, 1), rtol=1e-5)
    experts = RamExperts(_Experts(arch, g["experts.gate_up_proj"], g["experts.down_proj"]))
    rec = RoutingRecorder(arch)
    xs = x[0].numpy()
    shared = [dense[f"layers.{layer}.shared.{r}"] for r in ("gate", "up", "down")]
    y = routed_experts(xs, layer, arch, dense, experts, rec) + _swiglu(xs, *shared)
    assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) < 1e-5
    assert rec.counts.sum() == 24 * 3


def test_bf16_checkpoint_loads_exact_values(tmp_path):
    torch, _ = _torch()
    from _tiny_models import build
    from safetensors.torch import load_file
    build("glm4_moe", tmp_path, seed=5, dtype=torch.bfloat16)
    sd = load_file(str(tmp_path / "model.safetensors"))  # what transformers wrote, as torch bf16
    assert sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    w = load_checkpoint(tmp_path, "f32")
    np.testing.assert_array_equal(w.dense["embed"], sd["model.embed_tokens.weight"].float().numpy())
    np.testing.assert_array_equal(w.dense["layers.2.router_bias"],
                                  sd["model.layers.2.mlp.gate.e_score_correction_bias"].float().numpy())
    p = "model.layers.1.mlp.experts.5."
    for t, role in zip(w.expert(1, 5), ("gate", "up", "down")):
        np.testing.assert_array_equal(dequantize(t), sd[f"{p}{role}_proj.weight"].float().numpy())


def test_fused_expert_layout_loads_like_per_expert(olmoe_dir, tmp_path):
    from safetensors.numpy import load_file, save_file
    t = load_file(str(olmoe_dir / "model.safetensors"))
    out = _copy(olmoe_dir, tmp_path / "fused")
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp.experts."
        t[p + "gate_up_proj"] = np.stack([
            np.concatenate([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")])
            for e in range(8)])
        t[p + "down_proj"] = np.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    save_file(t, str(out / "model.safetensors"))
    a, b = load_checkpoint(olmoe_dir, "int4"), load_checkpoint(out, "int4")
    for key in [(0, 0), (1, 7)]:
        for qa, qb in zip(a.expert(*key), b.expert(*key)):
            np.testing.assert_array_equal(qa.data, qb.data)


def test_broken_checkpoints_fail_clearly(olmoe_dir, tmp_path):
    from safetensors.numpy import load_file, save_file
    with pytest.raises(InputError, match="config.json"):
        load_checkpoint(tmp_path / "nowhere")
    t = load_file(str(olmoe_dir / "model.safetensors"))
    cases = {
        "missing": ({k: v for k, v in t.items() if k != "model.layers.1.self_attn.k_norm.weight"},
                    "missing layers.1.attn.k_norm"),
        "expert": ({k: v for k, v in t.items() if k != "model.layers.0.mlp.experts.3.up_proj.weight"},
                   "expert 3 of layer 0 is missing"),
        "unknown": ({**t, "model.layers.0.mlp.mystery.weight": np.zeros(3, np.float32)},
                    "does not understand"),
        "shape": ({**t, "model.norm.weight": np.ones(63, np.float32)}, "final_norm"),
    }
    for name, (tensors, msg) in cases.items():
        folder = _copy(olmoe_dir, tmp_path / name)
        save_file(tensors, str(folder / "model.safetensors"))
        with pytest.raises(FormatError, match=msg):
            load_checkpoint(folder)
    folder = _copy(olmoe_dir, tmp_path / "mtp")  # tensors of layers past num_hidden_layers: MTP heads
    save_file({**t, "model.layers.2.eh_proj.weight": np.zeros((4, 4), np.float32)},
              str(folder / "model.safetensors"))
    assert load_checkpoint(folder).arch.n_layers == 2
    folder = _copy(olmoe_dir, tmp_path / "truncated")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(FormatError, match="truncated"):
        load_checkpoint(folder)


def test_model_input_errors_and_provider_seam(olmoe_dir):
    w = load_checkpoint(olmoe_dir)
    calls = []

    class Spy:
        def __init__(self):
            self.inner = RamExperts(w)

        def run(self, layer, expert_ids, xs, gates):
            calls.append((layer, list(expert_ids), [x.shape for x in xs], [g.shape for g in gates]))
            return self.inner.run(layer, expert_ids, xs, gates)

    with Model(w) as ref:
        want = ref.forward([1, 2, 3, 4, 5])
        with pytest.raises(InputError, match="outside the vocabulary"):
            ref.forward([1, 500])
        with pytest.raises(InputError, match="non-empty"):
            ref.forward([])
        heat = ref.routing.to_heat()
        assert heat.counts.shape == (2, 8) and heat.counts.sum() == 2 * 5 * 2
    spied = Model(w, experts=Spy())
    seen = []
    spied.routing.hooks.append(lambda layer, ids, weights: seen.append((layer, ids.shape, weights.shape)))
    got = spied.forward([1, 2, 3, 4, 5])
    np.testing.assert_array_equal(got, want)
    assert seen == [(0, (5, 2), (5, 2)), (1, (5, 2), (5, 2))]
    assert [c[0] for c in calls] == [0, 1]
    for _, ids, xshapes, gshapes in calls:
        assert ids == sorted(set(ids))  # distinct, ascending
        assert sum(s[0] for s in xshapes) == 5 * 2 and [s[0] for s in xshapes] == [s[0] for s in gshapes]


def test_in_memory_weights_check_shapes(olmoe_dir):
    w = load_checkpoint(olmoe_dir)
    experts = {k: w.expert(*k) for k in w.expert_keys()}
    InMemoryWeights(w.arch, w.dense, experts, "f32")
    with pytest.raises(FormatError, match="expert 2 of layer 1"):
        InMemoryWeights(w.arch, w.dense, {k: v for k, v in experts.items() if k != (1, 2)}, "f32")
    with pytest.raises(InputError, match="no routed experts"):
        w.expert(5, 0)
