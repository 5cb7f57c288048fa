"""Quantized dense trunk of a pack (issue 13, step 1): int8 trunk matmuls through the host backend."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
from _tiny_models import build  # noqa: E402

from colibri_plan.engine.dense_quant import QuantLinear, decode_dense, encode_dense  # noqa: E402
from colibri_plan.engine.forward import Model  # noqa: E402
from colibri_plan.engine.pack import open_pack, write_pack  # noqa: E402
from colibri_plan.engine.weights import load_checkpoint  # noqa: E402
from colibri_plan.errors import FormatError, IntegrityError  # noqa: E402

# a qwen2_moe whose trunk dominates: wide shared expert and dense FFN, few small experts
BIG_TRUNK = dict(intermediate_size=256, shared_expert_intermediate_size=256, num_experts=4,
                 moe_intermediate_size=16)


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dq")
    build("qwen2_moe", d / "ckpt", std=0.08, **BIG_TRUNK)  # std 0.15 makes greedy near-ties flip
    w = load_checkpoint(d / "ckpt", expert_format="f32")
    out = {f: write_pack(w, d / f, "int8", dense_format=f) for f in ("f32", "int8", "int4-g32")}
    return out


def test_int8_trunk_generates_like_f32(packs):
    prompt = [3, 17, 42, 99, 5]
    with open_pack(packs["f32"]) as p32, open_pack(packs["int8"]) as p8:
        m32, m8 = Model(p32), Model(p8)
        assert isinstance(p8.dense["layers.0.attn.q"], QuantLinear)
        assert isinstance(p8.dense["lm_head"], QuantLinear)
        assert isinstance(p8.dense["embed"], np.ndarray)
        assert isinstance(p8.dense["layers.0.router"], np.ndarray)
        t32, t8 = m32.generate(prompt, 16), m8.generate(prompt, 16)
        assert t32[:8] == t8[:8]
        l32, l8 = m32.forward(prompt), m8.forward(prompt)
        # per-row int8 keeps each weight within half a step (|w|max/254). Measured on this model (seeds
        # 0-2): max |Δlogit| = 0.025-0.039 for logits of std ~0.64, i.e. <= 0.06 std; 0.15 std is a 2.5x
        # margin that still catches a wrong scale or transposition (errors of the order of 1 std).
        assert np.max(np.abs(l32 - l8)) < 0.15 * float(np.std(l32))
        m32.close()
        m8.close()


def test_int8_dense_file_is_3x_smaller_and_indexed(packs):
    sizes = {f: (packs[f] / "dense.safetensors").stat().st_size for f in packs}
    assert sizes["f32"] >= 3 * sizes["int8"]
    assert sizes["int8"] > sizes["int4-g32"]
    with open_pack(packs["int8"]) as p:
        fmt = p.index["format"]
    assert fmt["dense_format"] == "int8"
    assert fmt["dense_tensors"]["layers.0.attn.q"] == "int8"
    assert "layers.0.router" not in fmt["dense_tensors"] and "embed" not in fmt["dense_tensors"]
    with open_pack(packs["int4-g32"]) as p:  # int4-g32 runs too
        with Model(p) as m:
            assert len(m.generate([1, 2, 3], 4)) == 4


def test_corrupt_dense_scale_is_caught(packs, tmp_path):
    import shutil

    from safetensors import safe_open
    bad = tmp_path / "bad"
    shutil.copytree(packs["int8"], bad)
    path = bad / "dense.safetensors"
    with safe_open(str(path), framework="numpy") as f:
        assert "layers.0.attn.q.scales" in f.keys()
    raw = bytearray(path.read_bytes())
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + hlen])
    start = 8 + hlen + header["layers.0.attn.q.scales"]["data_offsets"][0]
    raw[start + 1] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="crc32"):
        open_pack(bad)


def test_solve_budgets_the_int8_trunk(packs):
    from colibri_plan.model import load_model_spec
    from colibri_plan.planner.make import dense_read_bytes

    s8, s32 = load_model_spec(str(packs["int8"])), load_model_spec(str(packs["f32"]))
    assert (s8.dense_format, s32.dense_format) == ("int8", "f32")
    assert dense_read_bytes(s8, s8.dense_format) * 3 < dense_read_bytes(s32, s32.dense_format)


def test_decode_refuses_missing_scales():
    rng = np.random.default_rng(0)
    tensors, formats = encode_dense({"lm_head": rng.standard_normal((8, 16)).astype(np.float32)}, "int8")
    assert formats == {"lm_head": "int8"} and tensors["lm_head"].dtype == np.int8
    del tensors["lm_head.scales"]
    with pytest.raises(FormatError, match="scales"):
        decode_dense(tensors, formats, "t")


def test_cli_dense_quant_default_follows_the_checkpoint_dtype(tmp_path):
    import torch
    from _cli_fixtures import invoke

    build("qwen2_moe", tmp_path / "bf", dtype=torch.bfloat16)
    build("qwen2_moe", tmp_path / "f32")
    for src, extra, want in (("bf", (), "int8"), ("f32", (), "f32"), ("f32", ("--dense-quant", "int4-g32"),
                                                                      "int4-g32")):
        out = tmp_path / f"p-{src}-{want}"
        r = invoke("model", "pack", tmp_path / src, out, "--quant", "int8", *extra)
        assert r.exit_code == 0, r.output
        with open_pack(out) as p:
            assert p.index["format"]["dense_format"] == want
        r = invoke("model", "verify", out)
        assert r.exit_code == 0, r.output


def test_int4_g32h_pack_keeps_float16_scales_and_runs_alike(packs, tmp_path):
    # experts and trunk at int4-g32h: float16 scales on disk (a smaller dense file than int4-g32's at the
    # same codes), read back as stored; the cpu backend's tokens are the numpy reference's
    w = load_checkpoint(packs["f32"].parent / "ckpt", expert_format="f32")
    pk = write_pack(w, tmp_path / "g32h", "int4-g32h", dense_format="int4-g32h")
    dense = {f: (p / "dense.safetensors").stat().st_size for f, p in (("h", pk), ("g32", packs["int4-g32"]))}
    assert dense["h"] < dense["g32"]
    with open_pack(pk) as p:
        assert p.expert_format == "int4-g32h" and p.index["format"]["dense_tensors"]["lm_head"] == "int4-g32h"
        gate = p.expert(0, 0)[0]
        assert gate.fmt == "int4-g32h" and gate.scales.dtype == np.float16
        assert p.dense["layers.0.attn.q"].qt.scales.dtype == np.float16
        with Model(p, backend_name="numpy") as ref, Model(p, backend_name="cpu") as cpu:
            assert cpu.generate([3, 17, 42], 8) == ref.generate([3, 17, 42], 8)
