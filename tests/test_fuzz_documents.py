"""Fuzz suite of every document reader (issue 17): profile, model spec, heat JSON, colibrì usage text,
IKU1, plan, coefficients, verify report, config.json through the families, GGUF header; and a few
through the CLI (click's CliRunner).

Each case starts from a valid file, applies one hypothesis mutation (tests/_fuzz.py: truncation, byte
flips, inserted bytes; a value replaced by another type, a huge or non-finite number, a path string or a
100,000-deep nesting; a key dropped) and runs the reader in a forked child bounded to 1 GiB more memory
and 10 s. The reader must return or raise a one-line ColibriError; the CLI must exit 0 or 1 with one
"Error:" line and no traceback, and write no output file when it fails. Derandomized: CI runs the same
cases every time.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from _cli_fixtures import coef_file, heat_doc, invoke
from _fuzz import bounded, byte_mutations, check_outcome, fuzz, json_mutations, mutate_bytes, mutate_json
from _reports import toy_report
from _solver_fixtures import toy_profile, toy_spec
from hypothesis import given

from colibri_plan.errors import UnsupportedError
from colibri_plan.families import arch_from_config, spec_fields_from_config
from colibri_plan.fileio import read_json_object
from colibri_plan.formats.coefficients import load_coefficients
from colibri_plan.formats.heat import Heat, load_heat, read_iku1, read_usage_text, save_heat, write_usage_text
from colibri_plan.formats.plan import load_plan, save_plan
from colibri_plan.formats.profile import load_profile, save_profile
from colibri_plan.formats.report import load_report
from colibri_plan.model import load_model_spec, save_model_spec
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions

N = 60  # examples per reader (x ~10 readers: the whole module runs in well under a minute on 2 cores)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """One valid file of every document kind, as bytes, plus the parsed JSON ones."""
    d = tmp_path_factory.mktemp("fuzz-docs")
    prof = toy_profile(gpus=[{"gbps": 60.0, "free_bytes": 2 * 10**9}], ram_available_bytes=8 * 10**9)
    spec = toy_spec(n_experts=8)
    heat = Heat(n_experts=8, layers=(1, 2, 3), counts=np.array([[3, 1, 0, 0, 2, 0, 1, 1]] * 3), top_k=2,
                tokens=4, n_model_layers=4)
    plan, _, _ = make_plan(prof, spec, heat, SolveOptions(ram="4", context_tokens=100, trunk="cpu"))
    files = {"profile": save_profile(prof, d / "profile.json"), "spec": save_model_spec(spec, d / "m.json"),
             "heat": save_heat(heat, d / "heat.json"), "usage": write_usage_text(heat, d / "usage.txt"),
             "plan": save_plan(plan, d / "plan.json"), "coefficients": coef_file(d, cpu_expert=1.2),
             "report": d / "r.verify.json"}
    files["report"].write_text(json.dumps(toy_report()))
    out = {k: (p, p.read_bytes()) for k, p in files.items()}
    counts = np.array([[5, 0, 2, 1], [0, 0, 0, 0], [1, 1, 1, 5]], dtype="<u4")
    out["iku1"] = (None, b"IKU1" + struct.pack("<II", 3, 4) + counts.tobytes())
    return d, out


def _fuzz_file(tmp_path, data: bytes, reader, name: str = "doc.json", case: str = ""):
    path = tmp_path / name
    path.write_bytes(data)
    return check_outcome(bounded(reader, path), case)


def _doc(good, kind):
    return json.loads(good[1][kind][1])


READERS = {"profile": load_profile, "spec": load_model_spec, "heat": load_heat, "plan": load_plan,
           "coefficients": load_coefficients, "report": load_report}


@pytest.mark.parametrize("kind", list(READERS))
def test_json_document_readers_survive_mutations(good, tmp_path, kind):
    doc = _doc(good, kind)

    @fuzz(N)
    @given(m=json_mutations())
    def case(m):
        _fuzz_file(tmp_path, mutate_json(doc, m), READERS[kind], f"{kind}.json", f"{kind} {m!r:.200}")

    case()


def test_usage_text_reader_survives_mutations(good, tmp_path):
    data = good[1]["usage"][1]
    lines = data.decode().splitlines()

    @fuzz(N)
    @given(m=byte_mutations(), extra=st_lines())
    def case(m, extra):
        text = mutate_bytes(data, m) + ("\n".join(extra) + "\n").encode() if extra else mutate_bytes(data, m)
        _fuzz_file(tmp_path, text, read_usage_text, "usage.txt", f"usage {m!r} {extra!r:.200}")

    assert lines[0].startswith("-1 ")
    case()


def st_lines():
    """Extra usage rows: headers and triples with huge, negative and odd numbers."""
    from hypothesis import strategies as st

    num = st.sampled_from(["-2", "-1", "0", "1", "3", "2147483648", "1048576", "9" * 30, "-9" * 3, "1e3",
                           "x"])
    return st.lists(st.builds(lambda a, b, c: f"{a} {b} {c}", num, num, num), max_size=4)


def test_iku1_reader_survives_mutations(good, tmp_path):
    data = good[1]["iku1"][1]

    @fuzz(N)
    @given(m=byte_mutations())
    def case(m):
        _fuzz_file(tmp_path, mutate_bytes(data, m), read_iku1, "usage.iku1", f"iku1 {m!r}")

    case()


def _config_reader(path):
    cfg = read_json_object(path, "Hugging Face config.json")
    arch_from_config(cfg, plan_only=True, where=str(path))
    spec_fields_from_config(cfg, str(path))
    try:
        arch_from_config(cfg, where=str(path))  # the engine's stricter read
    except UnsupportedError:
        pass


CONFIGS = {
    "mixtral": dict(model_type="mixtral", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, num_local_experts=4,
                    intermediate_size=16, rope_theta=1e6, architectures=["MixtralForCausalLM"]),
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, num_experts=4,
                      moe_intermediate_size=8, intermediate_size=48, decoder_sparse_step=1,
                      mlp_only_layers=[0], head_dim=8, layer_types=None,
                      rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "glm4_moe": dict(model_type="glm4_moe", vocab_size=64, hidden_size=32, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, n_routed_experts=4,
                     moe_intermediate_size=8, n_shared_experts=1, first_k_dense_replace=1,
                     intermediate_size=48, num_nextn_predict_layers=1, partial_rotary_factor=0.5, n_group=2,
                     topk_group=1,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "deepseek_v3": dict(model_type="deepseek_v3", vocab_size=64, hidden_size=32, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, num_experts_per_tok=2,
                        n_routed_experts=8, moe_intermediate_size=8, n_shared_experts=1,
                        first_k_dense_replace=1,
                        intermediate_size=48, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                        v_head_dim=8, q_lora_rank=16, n_group=2, topk_group=1, moe_layer_freq=1),
    "gpt_oss": dict(model_type="gpt_oss", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, num_local_experts=4,
                    intermediate_size=16, head_dim=8, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_config_json_through_the_families_survives_mutations(tmp_path, family):
    cfg = CONFIGS[family]
    check_outcome(bounded(_config_reader, _write(tmp_path / "ok.json", cfg)), family)  # sanity

    @fuzz(N // 2)
    @given(m=json_mutations())
    def case(m):
        _fuzz_file(tmp_path, mutate_json(cfg, m), _config_reader, "config.json", f"{family} {m!r:.200}")

    case()


def _write(path, doc):
    path.write_text(json.dumps(doc))
    return path


def test_gguf_header_reader_survives_mutations(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2moe")
    for add, v in ((w.add_block_count, 2), (w.add_embedding_length, 16), (w.add_head_count, 2),
                   (w.add_head_count_kv, 1), (w.add_expert_count, 4), (w.add_expert_used_count, 2),
                   (w.add_expert_feed_forward_length, 8)):
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((20, 16), np.float32))
    for b in range(2):
        w.add_tensor(f"blk.{b}.ffn_gate_exps.weight", np.zeros((4, 8, 16), np.float32))
        w.add_tensor(f"blk.{b}.ffn_up_exps.weight", np.zeros((4, 8, 16), np.float32))
        w.add_tensor(f"blk.{b}.ffn_down_exps.weight", np.zeros((4, 16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = path.read_bytes()
    head = data[:2048]  # the header: mutations there, not in the zero tensor data

    @fuzz(N)
    @given(m=byte_mutations())
    def case(m):
        _fuzz_file(tmp_path, mutate_bytes(head, m) + data[len(head):], load_model_spec, "x.gguf",
                   f"gguf {m!r}")

    case()


# ---- through the CLI -------------------------------------------------------------------------------

def _solve(files: dict, out):
    res = invoke("solve", "--profile", files["profile"], "--model", files["spec"], "--heat", files["heat"],
                 "--coefficients", files["coefficients"], "--ram", "4", "--time-limit", "2", "--out", out)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code in (0, 1), (res.exit_code, res.output[-2000:], repr(res.exception))
    assert "Traceback" not in res.output, res.output[-2000:]
    if res.exit_code == 1:
        errors = [ln for ln in lines if ln.startswith("Error:")]
        assert len(errors) == 1, res.output[-2000:]
        assert not out.exists(), "solve failed but wrote its output file"


@pytest.mark.parametrize("kind", ["profile", "spec", "heat", "coefficients"])
def test_solve_cli_gives_one_line_and_writes_nothing_on_bad_input(good, tmp_path, kind):
    d, docs = good
    doc = _doc(good, kind)
    files = {k: p for k, (p, _) in docs.items() if p is not None}

    @fuzz(12)
    @given(m=json_mutations())
    def case(m):
        bad = tmp_path / f"bad-{kind}.json"
        bad.write_bytes(mutate_json(doc, m))
        out = tmp_path / "plan.json"
        out.unlink(missing_ok=True)
        check_outcome(bounded(_solve, {**files, kind: bad}, out), f"solve {kind} {m!r:.200}")

    case()


def test_heat_fixture_is_consistent(tmp_path):
    """The shared heat fixture obeys the tokens x top_k rule the reader now checks."""
    doc = heat_doc(tmp_path)
    assert all(sum(r) == doc["tokens"] * doc["top_k"] for r in doc["counts"])


def test_report_page_survives_mutated_verify_reports(good, tmp_path):
    """Whatever load_report accepts, the report page renders (or one typed error): no traceback."""
    from colibri_plan.report_page import build_page
    from colibri_plan.verify import compare, make_verdict

    doc = _doc(good, "report")
    doc.update({"settings": {"tokens": 4, "cpu_backend": "numpy"}, "created_utc": "2025-01-01T00:00:00Z",
                "comparison": compare(doc["predicted"], doc["measured"]),
                "verdict": make_verdict(doc["predicted"], doc["measured"], None)})
    plan = good[1]["plan"][0]

    @fuzz(N // 3)
    @given(m=json_mutations())
    def case(m):
        _fuzz_file(tmp_path, mutate_json(doc, m), lambda p: build_page(plan, [p], what_if=False),
                   "r.verify.json", f"report page {m!r:.200}")

    case()
