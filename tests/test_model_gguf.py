"""Sizing a model from a GGUF header written with the gguf package (llama.cpp's key and tensor names)."""

import numpy as np
import pytest

from colibri_plan.errors import FormatError, UnsupportedError
from colibri_plan.model import load_model_spec

gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF headers")

H, I, E, V = 32, 24, 4, 100


def _write(path, arch="qwen2moe", blocks=3, dense_blocks=(), nextn=0, shexp=40, ffn_len=I, mla=False,
           experts=True):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(blocks)
    w.add_embedding_length(H)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    if experts:
        w.add_expert_count(E)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(ffn_len)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    if mla:
        w.add_kv_lora_rank(8)
        w.add_rope_dimension_count(4)
    z = np.zeros
    w.add_tensor("token_embd.weight", z((V, H), np.float32))  # GGML dims [H, V]
    w.add_tensor("output.weight", z((V, H), np.float32))
    for b in range(blocks):
        w.add_tensor(f"blk.{b}.attn_q.weight", z((H, H), np.float32))
        if b in dense_blocks or not experts:
            w.add_tensor(f"blk.{b}.ffn_gate.weight", z((48, H), np.float32))
            continue
        w.add_tensor(f"blk.{b}.ffn_gate_inp.weight", z((E, H), np.float32))
        w.add_tensor(f"blk.{b}.ffn_gate_exps.weight", z((E, I, H), np.float32))  # GGML dims [H, I, E]
        w.add_tensor(f"blk.{b}.ffn_up_exps.weight", z((E, I, H), np.float32))
        w.add_tensor(f"blk.{b}.ffn_down_exps.weight", z((E, H, I), np.float32))  # GGML dims [I, H, E]
        if shexp:
            w.add_tensor(f"blk.{b}.ffn_gate_shexp.weight", z((shexp, H), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qwen2moe_header(tmp_path):
    s = load_model_spec(_write(tmp_path / "tiny-qwen2moe.gguf"))
    assert s.family == "qwen2_moe" and s.name == "tiny-qwen2moe"
    assert (s.n_layers, s.moe_layers, s.n_experts, s.top_k) == (3, (0, 1, 2), E, 2)
    assert (s.hidden_size, s.moe_intermediate_size) == (H, I)
    assert (s.shared_intermediate_size, s.n_shared_experts) == (40, 1)
    assert s.vocab_size == V
    # dense: embedding + output + per block attn_q [H,H], router [E,H], shared gate [40,H]
    assert s.dense_params == 2 * V * H + 3 * (H * H + E * H + 40 * H)
    assert s.kv_bytes_per_token == 3 * 2 * 2 * (H // 4) * 2  # blocks x K,V x kv heads x head dim x 2 B
    assert s.source.startswith("gguf: ")


def test_deepseek2_style_dense_lead_and_nextn(tmp_path):
    path = _write(tmp_path / "ds.gguf", arch="deepseek2", blocks=4, dense_blocks=(0,), nextn=1, mla=True)
    s = load_model_spec(path)
    assert s.n_layers == 3 and s.moe_layers == (1, 2, 3) and s.mtp_layers == (3,)
    assert s.n_routed_experts == 3 * E and s.cold_bytes_per_token("bf16") == 2 * 2 * 3 * H * I * 2
    assert s.kv_bytes_per_token == 4 * (8 + 4) * 2  # MLA latent + rope dims, 4 blocks, bf16


def test_gguf_dims_mismatch(tmp_path):
    with pytest.raises(FormatError, match="expected H 32 and I 20"):
        load_model_spec(_write(tmp_path / "bad.gguf", ffn_len=20))


def test_gguf_without_experts_is_unsupported(tmp_path):
    with pytest.raises(UnsupportedError, match="not a Mixture-of-Experts model"):
        load_model_spec(_write(tmp_path / "dense.gguf", arch="llama", experts=False))


def test_gguf_garbage_and_truncation(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(FormatError, match="not a readable GGUF file"):
        load_model_spec(junk)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(FormatError, match="GGUF"):
        load_model_spec(tmp_path / "empty.gguf")
    good = _write(tmp_path / "good.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[: len(good) - 1000])
    with pytest.raises(FormatError, match="truncated|not a readable GGUF"):
        load_model_spec(cut)


def test_old_gguf_without_contents_api(tmp_path, monkeypatch):
    """gguf < 0.11 has no ReaderField.contents(); the fallback reads the raw parts the same way."""
    path = _write(tmp_path / "ds.gguf", arch="deepseek2", blocks=4, dense_blocks=(0,), nextn=1, mla=True)
    new = load_model_spec(path)
    monkeypatch.delattr(gguf.ReaderField, "contents")
    assert load_model_spec(path) == new
