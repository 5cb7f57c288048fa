"""bench/cuda_decode_imma.py, bench/cuda_expert_ffn.py and bench/cpu_gemv.py refuse bad arguments with an
argparse usage error (exit 2, naming the argument) before the GPU, the backend or the RAM probe is touched,
and an --out that cannot take the result before the run rather than after it."""

import pytest
from test_bench_bad_args import bench  # loads a bench script as a module


def usage_error(monkeypatch, capsys, name: str, argv: list[str]) -> str:
    monkeypatch.setattr("sys.argv", [f"{name}.py", *argv])
    with pytest.raises(SystemExit) as exc:
        bench(name).main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err and "cuda unavailable" not in err, err
    return err


CASES = [
    ("cuda_expert_ffn", ["--tc-warps", "0"], "--tc-warps: expected warps per block in 1..8"),
    ("cuda_expert_ffn", ["--tc-warps", "16"], "got 16"),
    ("cuda_expert_ffn", ["--tc-warps=-2"], "got -2"),
    ("cuda_expert_ffn", ["--tc-from", "0"], "--tc-from: expected a token count >= 1, got 0"),
    ("cuda_expert_ffn", ["--tokens", "1,\u00b2"], "--tokens: expected token counts >= 1"),
    ("cuda_expert_ffn", ["--out", "{tmp}/no/such/x.json"], "--out: cannot write"),
    ("cuda_expert_ffn", ["--out", "{tmp}"], "it is a folder"),
    ("cuda_decode_imma", ["--out", "{tmp}/no/such/x.json"], "does not exist; create it first"),
    ("cuda_decode_imma", ["--variants", "gemv,"], "--variants: unknown ''"),
    ("cuda_decode_imma", ["--formats", "int4,int4-g64"], "--formats: 'int4-g64': decode_imma.cu"),
    ("cuda_decode_imma", ["--rounds", "0"], "--rounds must be >= 1"),
    ("cpu_gemv", ["--shapes", "bogus"], "--shapes: unknown 'bogus' (known: trunk 4096x4096"),
    ("cpu_gemv", ["--formats", "int8,q9"], "--formats: 'q9' not a quant format"),
    ("cpu_gemv", ["--repeats", "0"], "got --repeats 0"),
    ("cpu_gemv", ["--prefill=-1"], "--prefill -1"),
    ("cpu_gemv", ["--ram-bytes", "0"], "--ram-bytes 0"),
    ("cpu_gemv", ["--threads", "0"], "--threads must be 1.."),
    ("cpu_gemv", ["--threads", "100000"], "got 100000"),
    ("cpu_gemv", ["--out", "{tmp}"], "--out: cannot write"),
]


@pytest.mark.parametrize("name,argv,message", CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_bad_argument_is_a_usage_error_before_any_work(tmp_path, monkeypatch, capsys, name, argv, message):
    def refuse(*a, **k):
        raise AssertionError("the backend was looked up before the arguments were checked")

    monkeypatch.setattr("colibri_plan.backends.get_backend", refuse)
    err = usage_error(monkeypatch, capsys, name, [a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert message in err, err
    assert list(tmp_path.iterdir()) == []   # nothing made, nothing written


def test_cpu_gemv_makes_the_out_folder_before_the_work(tmp_path, monkeypatch, capsys):
    out = tmp_path / "a" / "b.json"
    err = usage_error(monkeypatch, capsys, "cpu_gemv", ["--out", str(out), "--repeats", "0"])
    assert "--repeats" in err and not out.parent.exists()   # a bad argument first: no folder made
    mod = bench("cpu_gemv")
    args = mod.argparse.Namespace(formats="int8", shapes="trunk 4096x4096", repeats=1, prefill=0,
                                  pool_bytes=1, ram_bytes=1, threads=None, out=str(out))
    mod.check_args(mod.argparse.ArgumentParser(), args)
    assert out.parent.is_dir() and not out.exists()


def test_speedup_vs_gemv_skips_rounds_whose_gemv_failed():
    mod = bench("cuda_decode_imma")
    mine = [{"round": 0, "kernel_s": 2.0}, {"round": 1, "kernel_s": 4.0}, {"round": 2, "kernel_s": 1.0}]
    assert mod.speedup_vs_gemv({0: 3.0, 2: 1.5}, mine) == pytest.approx((1.5 + 1.5) / 2)
    assert mod.speedup_vs_gemv({0: 3.0, 1: 2.0, 2: 5.0}, mine) == pytest.approx(1.5)   # 1.5, 0.5, 5.0
    assert mod.speedup_vs_gemv({}, mine) is None
