"""bench/peer_llamacpp_gpu.py's worker on the CPU backend and a tiny pack: the decode it times feeds the
given random ids (as llama-bench's tg does), counts the tiers that served every selection, and still
returns the greedy chain for the token check."""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "peer_llamacpp_gpu.py"


def _ask(pack: Path, reqs: list[dict]) -> list[dict]:
    argv = [sys.executable, str(BENCH), "worker", "--pack", str(pack), "--backend", "cpu", "--context", "64"]
    p = subprocess.run(argv, input="".join(json.dumps(r) + "\n" for r in reqs), capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert json.loads(lines[0])["ready"] is True
    return [json.loads(x) for x in lines[1:]]


def test_random_id_decode_counts_selections_and_keeps_the_greedy_chain(tiny_pack):
    arch = json.loads((tiny_pack / "pack.json").read_text())["arch"]
    n = 5
    base = {"prefill": [], "prompt": [3, 4, 5]}
    feed = [(7 * i + 11) % arch["vocab_size"] for i in range(n)]
    greedy, fed = _ask(tiny_pack, [{**base, "decode": n}, {**base, "decode": n, "decode_ids": feed}])
    assert fed["tokens"] == greedy["tokens"] and len(greedy["tokens"]) == n + 1
    # every MoE layer's top-k selections of every timed step, served by some tier
    n_moe = arch["n_layers"] - arch["first_k_dense_replace"]
    for r in (greedy, fed):
        assert sum(r["decode_uses"].values()) == n * n_moe * arch["top_k"], r["decode_uses"]


def test_heat_of_the_random_id_decode_counts_every_selection(tiny_pack, tmp_path):
    """`heat`: a 3-token prompt then 6 random-id decode steps on the CPU -> a heat file holding each MoE
    layer's top-k selections of all 9 tokens (the plan is then priced on the traffic the bench times)."""
    from colibri_plan.formats.heat import load_heat

    arch = json.loads((tiny_pack / "pack.json").read_text())["arch"]
    out = tmp_path / "heat.json"
    argv = [sys.executable, str(BENCH), "heat", "--pack", str(tiny_pack), "--backend", "cpu", "--depth", "3",
            "--tokens", "6", "--out", str(out)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    heat = load_heat(out)
    counts = heat.counts  # [MoE layers, E]
    n_moe = arch["n_layers"] - arch["first_k_dense_replace"]
    assert len(counts) == n_moe
    assert counts.sum(axis=1).tolist() == [9.0 * arch["top_k"]] * n_moe and heat.tokens == 9


def test_heat_of_several_conversations_holds_each_prompt_and_its_steps(tiny_pack, tmp_path):
    """`heat --conversations 2`: two runs of a 3-token prompt + 4 random-id steps on fresh caches -> the
    heat's trace has each prompt as one call then 4 one-token calls, and counts all 14 tokens; the decode
    ids differ between the two runs (the random stream goes on), the bench prompt is the same."""
    from colibri_plan.formats.heat import load_heat

    arch = json.loads((tiny_pack / "pack.json").read_text())["arch"]
    out = tmp_path / "heat2.json"
    argv = [sys.executable, str(BENCH), "heat", "--pack", str(tiny_pack), "--backend", "cpu", "--depth", "3",
            "--tokens", "4", "--conversations", "2", "--context", "bench", "--prefill", "8",
            "--out", str(out)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    heat = load_heat(out)
    assert heat.tokens == 14 and heat.trace.steps == (3, 1, 1, 1, 1, 3, 1, 1, 1, 1)
    n_moe = arch["n_layers"] - arch["first_k_dense_replace"]
    assert heat.counts.sum(axis=1).tolist() == [14.0 * arch["top_k"]] * n_moe
    rows = heat.trace.rows(heat.trace.layers[0])  # [14, K]
    assert rows[:3].tolist() == rows[7:10].tolist()  # the same bench prompt routes the same way
    bad = subprocess.run(argv[:-2] + ["--conversations", "0", "--out", str(out)], capture_output=True,
                         text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "--conversations, --tokens and --depth must be >= 1" in bad.stderr
