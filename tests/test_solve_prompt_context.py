"""`solve --prompt-tokens N` longer than `--context`: the plan's KV budget would not hold the prompt, so solve
warns (stderr and the --json document's warnings) and says what to pass; the default length is 512 tokens, or
the context when that is shorter, so it stays quiet."""

import json

import pytest
from _solver_fixtures import write_toy_files
from click.testing import CliRunner

from colibri_plan.cli import cli


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_toy_files(tmp_path_factory.mktemp("prompt-context"))


def solve(files, *extra):
    args = ["solve", "--profile", files / "profile.json", "--model", files / "model.json", "--ram", "0.58",
            *extra]
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


WANT = ("--prompt-tokens 300 is longer than --context 100: the plan budgets a KV cache of 100 tokens, so a "
        "prompt this long outgrows it; solve with --context 300 or more")


def test_a_prompt_past_the_context_warns_and_still_solves(files, tmp_path):
    r = solve(files, "--context", "100", "--prompt-tokens", "300", "--out", tmp_path / "plan.json")
    assert r.exit_code == 0, r.output
    assert f"warning: {WANT}" in r.stderr and (tmp_path / "plan.json").exists()
    doc = json.loads(solve(files, "--context", "100", "--prompt-tokens", "300", "--json").stdout)
    assert WANT in doc["warnings"] and doc["predicted"]["prefill"]["prompt_tokens"] == 300


def test_no_warning_within_the_context_or_at_the_default_length(files):
    for extra in (("--context", "300", "--prompt-tokens", "300"), ("--context", "100")):
        r = solve(files, *extra)
        assert r.exit_code == 0 and "--prompt-tokens" not in r.stderr, r.stderr


def test_the_default_prompt_fits_the_context(files):
    for context, want in (("100", 100), ("4096", 512)):
        doc = json.loads(solve(files, "--context", context, "--json").stdout)
        assert doc["predicted"]["prefill"]["prompt_tokens"] == want
        assert not [w for w in doc["warnings"] if "--prompt-tokens" in w]
