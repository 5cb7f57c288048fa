"""The prefill bench scripts refuse bad arguments with an argparse usage error (exit 2, one line naming the
argument) before building a fixture or running anything: no traceback from deep inside."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CASES = [
    ("prefill_accuracy", ["--prompts", "abc"], "argument --prompts: expected prompt lengths >= 1"),
    ("prefill_accuracy", ["--prompts", "16,0"], "got '16,0'"),
    ("prefill_accuracy", ["--prompts=-5"], "got '-5'"),
    ("prefill_accuracy", ["--prompts", "1.5"], "got '1.5'"),
    ("prefill_accuracy", ["--ram", "xyz"], "argument --ram: expected RAM budgets in GB (> 0) or auto"),
    ("prefill_accuracy", ["--ram=-1,auto"], "got '-1,auto'"),
    ("prefill_accuracy", ["--ram", "nan"], "got 'nan'"),
    ("prefill_accuracy", ["--repeats", "0"], "argument --repeats: expected a whole number >= 1, got '0'"),
    ("prefill_accuracy", ["--fixture", "{tmp}/none"], "/none is not a pack (no pack.json)"),
    ("cpu_decode_overhead", ["{tmp}/none"], "not a pack (no pack.json): "),
    ("cpu_decode_overhead", ["{tmp}", "--tokens", "0"], "argument --tokens: expected a whole number >= 1"),
    ("cpu_decode_overhead", ["{tmp}", "--rounds", "x"], "argument --rounds: expected a whole number >= 1"),
    ("cpu_decode_overhead", ["{tmp}", "--roots", "bogus"], "--roots takes NAME=DIR"),
    ("cpu_decode_overhead", ["{tmp}", "--roots", "a={tmp}/none"], "--roots takes NAME=DIR"),
    ("cuda_prefill", ["--prompt", "0"], "argument --prompt: expected a whole number >= 1, got '0'"),
    ("cuda_prefill", ["--tokens", "-1"], "argument --tokens: expected a whole number >= 1, got '-1'"),
    ("cuda_prefill", ["--repeats", "two"], "argument --repeats: expected a whole number >= 1"),
]


@pytest.mark.parametrize("name,argv,message", CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_bad_argument_is_a_usage_error(tmp_path, capsys, name, argv, message):
    (tmp_path / "pack.json").write_text("{}")   # a folder that passes the pack check (never opened)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exc:
        bench(name).main([*argv, "--out", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack.json"]   # nothing made, nothing written


def test_good_arguments_parse_to_lists():
    mod = bench("prefill_accuracy")
    assert mod._lengths("16, 64,256") == [16, 64, 256]
    assert mod._budgets("auto,1.5") == ["auto", "1.5"]


FFN_CASES = [(["--formats", "int4,bogus", "--gemv-sweep"], "--formats: bogus not a quant format"),
             (["--tokens", "1,abc"], "--tokens: expected token counts >= 1"),
             (["--tokens", "0"], "--tokens: expected token counts >= 1"),
             (["--tc-rows", "x"], "--tc-rows: expected two counts >= 1"),
             (["--experts", "0"], "--experts, --pool and --calls must be >= 1")]


@pytest.mark.parametrize("argv,message", FFN_CASES, ids=[" ".join(c[0]) for c in FFN_CASES])
def test_cuda_expert_ffn_refuses_bad_arguments_before_the_gpu(monkeypatch, capsys, argv, message):
    monkeypatch.setattr("sys.argv", ["cuda_expert_ffn.py", *argv])
    with pytest.raises(SystemExit) as exc:
        bench("cuda_expert_ffn").main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "cuda unavailable" not in err, err
