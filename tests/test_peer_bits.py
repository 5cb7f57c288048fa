"""bench/peer_llamacpp.py states the stored bits per weight of each side: ours from the quant module's
bytes (codes + float32 scales) over the matrices the benchmark's pack quantizes, llama.cpp's from its
block formats."""

from __future__ import annotations

import pytest
from test_bench_bad_args import bench


def test_bits_per_weight_of_each_side():
    peer = bench("peer_llamacpp")
    shapes = peer.quantized_shapes()
    s = peer.SIZES
    assert len(shapes) == s["num_hidden_layers"] * (4 + 3 * s["num_experts"]) + 1
    weights = sum(o * c for o, c in shapes)
    rows = sum(o for o, _ in shapes)
    # int8: one byte a weight plus one float32 scale per row
    assert peer.bits_per_weight("int8") == pytest.approx((8 * weights + 32 * rows) / weights, rel=1e-12)
    assert round(peer.bits_per_weight("int8"), 3) == 8.021            # the figure the docs quote
    assert peer.bits_per_weight("int4-g32") == 5.0                     # 4 + 32 bits per 32 weights
    assert peer.bits_per_weight("int4-g32h") == 4.5                    # 4 + 16 bits per 32: Q4_0's
    assert (peer.bits_per_weight("Q8_0"), peer.bits_per_weight("Q4_0")) == (8.5, 4.5)


def test_sizes_of_a_given_checkpoint_come_from_its_config(tmp_path):
    """--ckpt: the bits per weight are of that checkpoint's matrices (24 layers, expert width 768)."""
    import json

    peer = bench("peer_llamacpp")
    cfg = {**peer.SIZES, "num_hidden_layers": 24, "moe_intermediate_size": 768, "vocab_size": 32000,
           "num_attention_heads": 32, "architectures": ["Qwen3MoeForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sizes = peer.checkpoint_sizes(tmp_path)
    assert set(sizes) == set(peer.SIZES) and sizes["num_hidden_layers"] == 24
    h, i, q, kv = 2048, 768, 32 * 128, 4 * 128
    layer = [(q, h), (kv, h), (kv, h), (h, q)] + [(i, h), (i, h), (h, i)] * 32
    assert peer.quantized_shapes(sizes) == layer * 24 + [(32000, h)]
    weights = sum(o * c for o, c in peer.quantized_shapes(sizes))
    rows = sum(o for o, _ in peer.quantized_shapes(sizes))
    want = (8 * weights + 32 * rows) / weights
    assert peer.bits_per_weight("int8", sizes) == pytest.approx(want, rel=1e-12)
