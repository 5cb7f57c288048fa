"""`colibri-plan run`: tokens equal the engine API's, prompt parsing, clear errors, statistics files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.cli.common import parse_prompt
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.forward import Model
from colibri_plan.engine.pack import open_pack
from colibri_plan.errors import InputError
from colibri_plan.formats.heat import load_heat

PROMPT = [5, 80, 200, 7, 211]


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "fx"
    build_fixture(out, FixtureConfig.small(layers=2, experts=16, top_k=4, vocab=300))
    return out


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_run_tokens_equal_engine_api(fx):
    res = invoke("run", "--model", fx, "--prompt-ids", ",".join(map(str, PROMPT)), "--tokens", 10, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    want = Model(open_pack(fx)).generate(PROMPT, 10)
    assert doc["tokens"] == want
    assert doc["prompt_tokens"] == 5 and doc["decode_steps"] == 9
    assert doc["decode_s_per_token"] > 0 and doc["tok_s"] == pytest.approx(1 / doc["decode_s_per_token"])
    assert doc["prefill_s"] > 0 and doc["plan"] is None
    assert doc["prefill_terms"]["experts_s"] > 0 and doc["prefill_terms"]["disk_bytes"] == 0
    # the same report as `run --plan`: the plan's vocabulary, every expert pinned in RAM
    assert set(doc["hit_rate"]) == {"vram", "ram_pinned", "lru", "disk"}
    assert doc["hit_rate"]["ram_pinned"] == 1
    assert doc["terms"]["expert_compute_s"]["cpu"] > 0 and doc["disk_bytes_per_token"] == 0


def test_run_without_plan_equals_run_with_a_plan(fx, tmp_path):
    """One run path: without a plan (every expert pinned) and with one (half of each layer streamed)
    the engine gives identical tokens and the same report keys; Placement.from_plan reads the plan."""
    from colibri_plan.engine import runner
    from colibri_plan.engine.placement import Placement
    from colibri_plan.formats.plan import TIER_RAM, Plan, layers_from_tiers
    from colibri_plan.run_options import RunOptions

    pack = open_pack(fx)
    a = pack.arch
    tiers = np.full((len(a.moe_layers), a.n_experts), TIER_RAM)
    tiers[:, : a.n_experts // 2] = -2           # half of every layer streamed from disk
    doc = {"layers": layers_from_tiers(a.moe_layers, tiers, np.full(len(a.moe_layers), 2), []),
           "devices": [], "model": {"n_experts": a.n_experts}, "resources": {"disk_queue_depth": 4}}
    plan = Plan(doc)
    pl = Placement.from_plan(plan)
    assert pl.layer(a.moe_layers[0]).ram_pinned == list(range(a.n_experts // 2, a.n_experts))
    assert pl.layer(a.moe_layers[0]).lru_slots == 2 and plan.read_threads == 4
    plain = runner.generate(pack, PROMPT, RunOptions(tokens=8, backend="numpy"))
    planned = runner.generate(pack, PROMPT, RunOptions(tokens=8, backend="numpy"), plan=plan)
    assert plain.tokens == planned.tokens == Model(open_pack(fx)).generate(PROMPT, 8)
    assert planned.hit_rate["disk"] > 0 and plain.hit_rate["disk"] == 0
    # the prefill's own figures: all pinned without a plan; with it the empty LRU reads whole experts
    block = max(pack.expert_location(layer, 0)[1] for layer in a.moe_layers)
    pre, pp = plain.prefill_terms, planned.prefill_terms
    assert pre["disk_bytes"] == 0 and pre["hit_rate"]["ram_pinned"] == 1 and pre["experts_s"] > 0
    assert pp["hit_rate"]["disk"] > 0 and pp["disk_bytes"] > 0 and pp["disk_bytes"] % block == 0
    assert pp["experts_s"] >= pp["disk_wait_s"] >= 0
    assert set(plain.to_dict()["terms"]) == set(planned.to_dict()["terms"])
    assert set(plain.to_dict()) - {"disk_read_gbps"} == set(planned.to_dict()) - {"disk_read_gbps"}
    pack.close()


def test_prompt_file_and_human_output(fx, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("5, 80\n200\t7 ,211\n")
    res = invoke("run", "--model", fx, "--prompt-file", f, "--tokens", 4)
    assert res.exit_code == 0, res.output
    first = res.stdout.splitlines()[0].split()
    assert [int(t) for t in first] == Model(open_pack(fx)).generate(PROMPT, 4)
    assert "tok/s" in res.stdout and "prefill 5 tokens" in res.stdout
    assert "prefill: experts " in res.stdout and "disk 0.0 MB read" in res.stdout   # every expert pinned


def test_prefill_terms_are_the_residency_statistics_of_the_prefill():
    from colibri_plan.engine.session import prefill_terms
    from colibri_plan.engine.tierstats import TierStats

    st = TierStats(disk_bytes=3_000_000, disk_read_s=0.03, disk_busy_s=0.02, disk_wait_s=0.01,
                   cpu_compute_s=0.2, device_compute_s={"cuda:0": 0.05}, layer_wall_s=0.3)
    st.uses.update(ram_pinned=6, disk=2)                 # 8 expert uses, 2 of them reads
    assert prefill_terms(None) is None
    assert prefill_terms(st) == {"experts_s": 0.3, "expert_compute_s": {"cpu": 0.2, "cuda:0": 0.05},
                                 "disk_wait_s": 0.01, "disk_read_s": 0.03, "disk_busy_s": 0.02,
                                 "disk_bytes": 3_000_000,
                                 "hit_rate": {"vram": 0.0, "ram_pinned": 0.75, "lru": 0.0, "disk": 0.25},
                                 # host experts a long GPU prefill computed on the device (engine/offload.py)
                                 "offloaded_experts": 0, "offload_h2d_bytes": 0, "offload_h2d_s": 0.0}


def test_parse_prompt():
    assert parse_prompt(" 1,2 ,3\n4 ", "x") == [1, 2, 3, 4]
    with pytest.raises(InputError, match="empty"):
        parse_prompt(" , \n", "x")
    with pytest.raises(InputError, match="'a' is not a token id"):
        parse_prompt("1 a 2", "x")
    with pytest.raises(InputError, match="is not a token id"):
        parse_prompt("1 -2", "x")


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,300"], "token id 300 is outside the vocabulary 0..299"),
    (["--prompt-ids", " "], "prompt is empty"),
    (["--prompt-ids", "1,x"], "'x' is not a token id"),
    ([], "exactly one of --prompt-ids"),
    (["--prompt-ids", "1", "--prompt-file", "p.txt"], "exactly one of --prompt-ids"),
    (["--prompt-file", "/nonexistent/p.txt"], "does not exist"),
])
def test_bad_input_gives_clear_errors(fx, args, message):
    res = invoke("run", "--model", fx, "--tokens", 2, *args)
    assert res.exit_code == 1 and message in res.output, res.output
    assert "Traceback" not in res.output


def test_missing_or_wrong_model(tmp_path):
    res = invoke("run", "--model", tmp_path / "nope", "--prompt-ids", "1")
    assert res.exit_code == 1 and "does not exist" in res.output
    res = invoke("run", "--model", tmp_path, "--prompt-ids", "1")
    assert res.exit_code == 1 and "neither an expert pack" in res.output
    res = invoke("run", "--model", tmp_path, "--prompt-ids", "1", "--tokens", 0)
    assert res.exit_code == 2


def test_stats_files_round_trip_through_heat(fx, tmp_path):
    stats, usage = tmp_path / "heat.json", tmp_path / "usage.txt"
    res = invoke("run", "--model", fx, "--prompt-ids", "1,2,3", "--tokens", 6, "--stats-out", stats,
                 "--usage-out", usage, "--json")
    assert res.exit_code == 0, res.output
    model = Model(open_pack(fx))
    model.generate([1, 2, 3], 6)
    want = np.asarray(model.routing.counts, dtype=np.float64)  # [2, 16]
    # every token that went through the model (3 prompt + 5 fed back) chose top_k = 4 experts per layer
    np.testing.assert_array_equal(want.sum(axis=1), [8 * 4, 8 * 4])
    h = load_heat(stats)
    assert h.layers == (0, 1) and h.n_experts == 16
    np.testing.assert_array_equal(h.counts, want)
    assert h.model_fingerprint == open_pack(fx).model_fingerprint
    u = load_heat(usage)
    np.testing.assert_array_equal(u.counts, want)
    assert usage.read_text().splitlines()[0] == "-1 2 16"
