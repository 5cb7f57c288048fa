"""The solve answer's lines: the pasted colibri-plan command fits the pack (text or token ids), and the
notes kept without -v."""

from __future__ import annotations

import json


def test_the_pasted_run_command_fits_the_pack(tmp_path):
    """solve's colibri-plan line: a text chat prompt for a pack with tokenizer files (or a pack not made
    yet), token ids for a pack without them (a fixture: `run --prompt` would refuse)."""
    from colibri_plan.planner.exports import colibri_plan_command

    (tmp_path / "ids").mkdir()
    (tmp_path / "ids" / "pack.json").write_text(json.dumps({"kind": "pack"}))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "pack.json").write_text(json.dumps({"kind": "pack", "tokenizer": {"files": []}}))
    assert "--prompt-ids 1,2,3,4 --tokens 64" in colibri_plan_command("p.json", str(tmp_path / "ids"))
    assert "--chat --prompt Hello --tokens 64" in colibri_plan_command("p.json", str(tmp_path / "text"))
    assert "--chat --prompt Hello" in colibri_plan_command("p.json", "/path/to/model-pack")


def test_the_answer_says_when_a_peer_figure_leaves_the_ram_budget():
    """Without -v the answer keeps the notes a paste needs and the one saying llama.cpp's figure counts on
    page cache beyond --ram (with the figure inside it); the others wait for -v."""
    from colibri_plan.cli.solve_text import answer_lines

    beyond = ("priced with the OS page cache its mmap takes beyond the plan's RAM budget (up to 8.0 GB here: "
              "60% of its CPU layers' reads); keeping to the budget, as --compare's rows do: 4.02 tok/s")
    other = "time to first token: our prefill model at this placement and llama.cpp's reads"
    result = {"model": "m", "profile": "p", "predicted": {"tok_s": 4.77}, "plan_written": True,
              "plan_file": "plan.json", "usage_file": None,
              "engines": [{"engine": "llama.cpp", "tok_s": 20.2, "ttft_s": 1.0,
                           "command": "llama-server -m X",
                           "notes": ["-m: the model's GGUF file (replace X, or solve --gguf FILE)", other,
                                     beyond]}]}
    out = "\n".join(answer_lines(result))
    assert "replace X" in out and "keeping to the budget, as --compare's rows do: 4.02 tok/s" in out
    assert other not in out
    assert other in "\n".join(answer_lines(result, verbose=True))
