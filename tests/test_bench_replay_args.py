"""bench/replay_llamacpp.py without llama.cpp: bad arguments are usage errors (exit 2, one line naming
the argument) before anything is built or run; the placements' two spellings; the readers of what
llama.cpp's tools print (lines as this llama.cpp build prints them); the GLM checkpoint writer against
transformers' own layout."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench(name: str):
    """A bench module by its own name (the script imports its helpers beside it by theirs)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)   # dataclasses look their module up
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def fake_bin(tmp_path, tools=("llama-bench", "llama-fit-params", "llama-completion", "llama-quantize")):
    d = tmp_path / "bin"
    d.mkdir()
    for t in tools:
        (d / t).write_text("")
    return d


CASES = [
    (["placements", "--ram-gb", "0"], "argument --ram-gb: expected a memory budget in GB (> 0), got '0'"),
    (["placements", "--ram-gb=-1"], "got '-1'"),
    (["placements", "--ram-gb", "nan"], "got 'nan'"),
    (["placements", "--ram-gb", "4", "--threads", "0"], "argument --threads: expected a whole number >= 1"),
    (["placements", "--ram-gb", "4", "--repeats", "x"], "argument --repeats: expected a whole number >= 1"),
    (["placements", "--ram-gb", "4", "--quant", "Q5_K"], "argument --quant: invalid choice: 'Q5_K'"),
    (["beyond-ram", "--ram-gb", "2.5", "--skew", "2"], "argument --skew: expected a number in [0, 1]"),
    (["beyond-ram", "--ram-gb", "2.5", "--experts", "-3"], "argument --experts: expected a whole number"),
    (["placements", "--ram-gb", "4", "--llama-bin", "{tmp}/none"], "/none: not a folder"),
    (["placements", "--ram-gb", "4", "--llama-bin", "{tmp}/some"], "no llama-fit-params, llama-completion"),
    (["placements", "--ram-gb", "4", "--gguf", "{tmp}/no.gguf"], "--gguf {tmp}/no.gguf: no such file"),
    (["placements", "--ram-gb", "4", "--gguf", "{tmp}/m.gguf", "--pack", "{tmp}"], "not a pack"),
    (["beyond-ram", "--ram-gb", "2", "--profile", "{tmp}/p.json"], "--profile {tmp}/p.json: no such file"),
    (["beyond-ram", "--ram-gb", "2", "--out", "{tmp}/no/r.json"], "r.json: its folder does not exist"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_argument_is_a_usage_error(tmp_path, capsys, argv, message):
    good = fake_bin(tmp_path)
    some = tmp_path / "some"
    some.mkdir()
    (some / "llama-bench").write_text("")
    (tmp_path / "m.gguf").write_text("")
    argv = [x.replace("{tmp}", str(tmp_path)) for x in argv]
    before = sorted(p.name for p in tmp_path.iterdir())
    base = ["--llama-bin", str(good), "--out", str(tmp_path / "out.json"), "--work", str(tmp_path / "w")]
    with pytest.raises(SystemExit) as exc:
        bench("replay_llamacpp").main([argv[0], *base, *argv[1:]])   # later options win over base
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message.replace("{tmp}", str(tmp_path)) in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before       # nothing made, nothing written


def test_no_memory_cgroup_is_said_before_running(tmp_path):
    cg = bench("replay_cgroup")
    assert "no cgroup v1 memory controller" in cg.check_cgroup(tmp_path)
    with pytest.raises(RuntimeError, match="no cgroup v1 memory controller"):
        cg.run_limited(["true"], 1 << 30, root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_placements_in_both_spellings():
    ll = bench("replay_llama")
    export = ll.Placement("export", "ours", overrides=[r"blk\.(0|2)\.ffn_(gate|up|down)_exps=CPU",
                                                       r"blk\.(1|3)\.ffn_(gate|up|down)_exps=CUDA0"], ngl=9)
    rows = {p.name: p for p in ll.standard_placements(8, None, export)}
    assert list(rows) == ["default", "export", "cpu-moe", "n-cpu-moe-4", "down-split", "no-repack",
                          "no-mmap"]
    assert rows["default"].bench_args() == [] and rows["default"].common_args() == []
    a, b = export.overrides
    assert rows["export"].bench_args() == ["-ot", f"{a};{b}", "-ngl", "9"]
    assert rows["export"].common_args() == ["-ot", f"{a},{b}", "-ngl", "9"]
    assert rows["cpu-moe"].bench_args() == ["-ot", r"\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"]
    assert rows["cpu-moe"].common_args() == ["--cpu-moe"]
    assert rows["n-cpu-moe-4"].bench_args() == ["-ncmoe", "4"]
    assert rows["n-cpu-moe-4"].common_args() == ["--n-cpu-moe", "4"]
    assert rows["down-split"].common_args() == ["-ot", r"\.ffn_down_exps=CPU"]
    assert rows["no-repack"].bench_args() == ["--repack", "0"]
    assert rows["no-repack"].common_args() == ["--no-repack"]
    assert rows["no-mmap"].bench_args() == ["-lm", "none"]
    assert rows["no-mmap"].common_args() == ["--load-mode", "none"]
    argv = ll.bench_argv(Path("/b"), Path("m.gguf"), rows["n-cpu-moe-4"], 2, 512, 64, 256)
    assert argv == ["/b/llama-bench", "-m", "m.gguf", "-t", "2", "-p", "512", "-n", "64", "-ub", "256", "-r",
                    "1", "-o", "json", "-ncmoe", "4"]
    assert [p.name for p in ll.standard_placements(9, None, None, n_cpu_moe=3)][1] == "cpu-moe"


def test_fit_answer_read_back():
    ll = bench("replay_llama")
    p = ll.parse_fit_args("some log\n-c 512 -ngl -1\n")        # this CPU build at a budget it meets
    assert (p.ctx, p.ngl, p.overrides, p.bench_args()) == (512, None, [], [])
    p = ll.parse_fit_args('-c 4096 -ngl 48 -ot "blk\\.14\\.ffn_(up|down|gate)_(ch|)exps=CPU,'
                          'blk\\.15\\.ffn_(up|down|gate)_(ch|)exps=CPU"\n')
    assert (p.ctx, p.ngl) == (4096, 48)
    assert p.overrides == [rf"blk\.{n}\.ffn_(up|down|gate)_(ch|)exps=CPU" for n in (14, 15)]
    assert p.bench_args()[:2] == ["-ot", ";".join(p.overrides)]
    with pytest.raises(ValueError, match="no '-c N -ngl N' line"):
        ll.parse_fit_args("llama_fit_params: failed to fit CLI arguments to free memory, exiting...")
    assert ll.parse_fit_print("0.00.003 I llama_fit_params: printing ...\nHost 1753 8 64\n") == [
        {"device": "Host", "model_mib": 1753, "context_mib": 8, "compute_mib": 64}]


LOG = """\
0.00.023.452 I common_memory_breakdown_print: | memory breakdown [MiB] | total free self |
0.00.023.484 I common_memory_breakdown_print: | - Host | 87 = 11 + 12 + 64 |
0.00.041.082 I load_tensors:   CPU_Mapped model buffer size =   884.14 MiB
0.00.041.104 I load_tensors:   CPU_REPACK model buffer size =   918.00 MiB
0.00.555.126 I llama_context:        CPU  output buffer size =     0.03 MiB
0.00.555.174 I llama_kv_cache:        CPU KV buffer size =    12.00 MiB
0.00.562.838 I sched_reserve:        CPU compute buffer size =    64.76 MiB
0.03.252.153 I common_perf_print: prompt eval time =     341.29 ms /     4 tokens (   85.32 ms per token)
0.03.252.154 I common_perf_print:        eval time =    1304.42 ms /     3 runs   (  434.81 ms per token)
0.03.252.193 I common_memory_breakdown_print: | memory breakdown [MiB] | total free self |
0.03.252.194 I common_memory_breakdown_print: | - Host | 960 = 884 + 12 + 64 |
0.03.252.194 I common_memory_breakdown_print: | - CPU_REPACK | 918 = 918 + 0 + 0 |
"""
GPU_ROW = ("llama_memory_breakdown_print: |   - CUDA0 (RTX 4090)   | 24077 =  945 + (19187 = 17904 +"
           "     384 +     898) +        3945 |")


def test_memory_breakdown_read_back():
    ll = bench("replay_llama")
    assert ll.parse_buffers(LOG) == [
        {"buffer_type": "CPU_Mapped", "kind": "model", "mib": 884.14},
        {"buffer_type": "CPU_REPACK", "kind": "model", "mib": 918.0},
        {"buffer_type": "CPU", "kind": "output", "mib": 0.03},
        {"buffer_type": "CPU", "kind": "KV", "mib": 12.0},
        {"buffer_type": "CPU", "kind": "compute", "mib": 64.76}]
    tables = ll.parse_breakdown(LOG)      # fit's projection at start-up, and the table printed at exit
    assert tables["projected"] == [{"name": "Host", "self_mib": 87, "model_mib": 11, "context_mib": 12,
                                    "compute_mib": 64}]
    assert tables["at_exit"] == [
        {"name": "Host", "self_mib": 960, "model_mib": 884, "context_mib": 12, "compute_mib": 64},
        {"name": "CPU_REPACK", "self_mib": 918, "model_mib": 918, "context_mib": 0, "compute_mib": 0}]
    died = LOG[:LOG.index("0.03.252.153")]          # killed before its timings: no table at exit
    assert ll.parse_breakdown(died)["at_exit"] is None and ll.parse_breakdown(died)["projected"]
    gpu = ll.parse_breakdown("common_perf_print: done\nllama_memory_breakdown_print: | memory breakdown"
                             " [MiB] | total free |\n" + GPU_ROW)["at_exit"]
    assert gpu == [{"name": "CUDA0 (RTX 4090)", "total_mib": 24077, "free_mib": 945, "self_mib": 19187,
                    "model_mib": 17904, "context_mib": 384, "compute_mib": 898, "unaccounted_mib": 3945}]
    assert ll.parse_perf(LOG) == {"prompt_eval_time_ms": 341.29, "prompt_eval_time_tokens": 4,
                                  "eval_time_ms": 1304.42, "eval_time_tokens": 3}


def test_llama_bench_json_read_back():
    ll = bench("replay_llama")
    common = {"model_size": 974274560, "model_n_params": 1728614400, "n_threads": 2, "n_ubatch": 512}
    out = ll.parse_bench('[{"n_prompt": 512, "n_gen": 0, "avg_ts": 162.7, "samples_ts": [162.7], %s},'
                         ' {"n_prompt": 0, "n_gen": 64, "avg_ts": 89.2, "samples_ts": [89.2], %s}]'
                         % ((", ".join(f'"{k}": {v}' for k, v in common.items()),) * 2))
    assert [(t["test"], t["avg_ts"], t["n_threads"]) for t in out] == [("pp", 162.7, 2), ("tg", 89.2, 2)]
    assert out[0]["bytes_per_weight"] == pytest.approx(974274560 / 1728614400)
    with pytest.raises(ValueError, match="printed no JSON"):
        ll.parse_bench("error: failed to load model")


def test_skew_bias_ranks_experts():
    rm = bench("replay_models")
    bias = rm.skew_bias(4, 0.1, [2, 0, 3, 1])      # expert 2 hottest, then 0, 3, 1
    assert bias[2] == 0.0 and bias[0] == pytest.approx(-0.1 * 0.6931471805599453)
    assert bias[2] > bias[0] > bias[3] > bias[1]
    assert rm.skew_bias(3, 0.0, [0, 1, 2]) == [0.0, 0.0, 0.0]


def test_glm_writer_matches_transformers_and_our_importer(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    rm = bench("replay_models")
    sz = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)
    cfg = {k: v for k, v in rm.glm_config(sz).items() if k not in ("architectures", "model_type", "dtype")}
    transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**cfg)).save_pretrained(str(tmp_path / "hf"))
    from safetensors import safe_open

    theirs = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):   # the layout save_pretrained writes (per expert)
        with safe_open(str(f), "np") as st:
            theirs |= {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
    ours = {f"model.layers.{i}.{k}": v for i in range(3) for k, v in rm.glm_layer_shapes(sz, i).items()}
    ours |= {"model.embed_tokens.weight": (128, 64), "model.norm.weight": (64,), "lm_head.weight": (128, 64)}
    assert ours == theirs
    rm.build_glm(tmp_path / "ckpt", sz, skew=0.1)
    from colibri_plan.engine.weights import load_checkpoint

    w = load_checkpoint(tmp_path / "ckpt")
    assert (w.arch.family, w.arch.n_experts, list(w.arch.moe_layers)) == ("glm4_moe", 8, [1, 2])
    for layer in (1, 2):   # the correction bias: -0.1 ln(rank), one expert per rank
        got = sorted(w.dense[f"layers.{layer}.router_bias"].tolist(), reverse=True)
        assert got == pytest.approx([-0.1 * math.log(r + 1) for r in range(8)], abs=1e-6)


def test_doc_tables_resolve_against_their_result_files(tmp_path):
    """bench/replay_tables.py's tables of every committed replay result: each tag resolves to the figure
    printed before it (tests/_doc_figures.py's check), and a changed figure is caught."""
    import _doc_figures as df

    files = sorted(df.RESULTS.glob("replay-*.json"))
    if not files:
        pytest.skip("no replay result files under bench/results (bench/replay_llamacpp.py writes them)")
    rt = bench("replay_tables")
    for f in files:
        doc = json.loads(f.read_text())
        md = tmp_path / f"{f.stem}.md"
        table = (rt.placements_table if doc["mode"] == "placements" else rt.beyond_table)(doc, f.name)
        md.write_text(table + "\n")
        tagged, untagged = df.scan(md)
        rows = doc["placements"] if doc["mode"] == "placements" else list(doc["rows"].values())
        assert len(tagged) >= 4 * len(rows) and untagged == []
        assert [df.check(fig, file, expr) for fig, file, expr in tagged] == [None] * len(tagged)
        first = tagged[0][0]
        wrong = first.text[:-1] + str((int(first.text[-1]) + 1) % 10)   # one digit off
        md.write_text(table[:first.start] + wrong + table[first.start + len(first.text):] + "\n")
        fig, file, expr = df.scan(md)[0][0]
        assert df.check(fig, file, expr) is not None


def test_reprice_rewrites_llama_rows_and_keeps_ours(tmp_path):
    """`reprice` of the stored beyond-ram file with the stored fault probe: the llama.cpp rows get the
    page-fault model's figures (the cyclic worst case: every mapped page a token reads is a miss), the
    --no-mmap row the predicted outcome the run had, and our rows keep their plans' predictions."""
    m = bench("replay_llamacpp")
    root = Path(__file__).resolve().parents[1]
    src = json.loads((root / "bench/results/replay-beyond-ram-2.5gb.json").read_text())
    f = tmp_path / "r.json"
    f.write_text(json.dumps(src))
    probe = root / "bench/results/mmap-fault-probe-2core.json"
    assert m.main(["reprice", str(f), "--fault-probe", str(probe),
                   "--profile", str(root / "tests/data/replay-profile-int8.json"),
                   "--coef", str(root / "bench/results/llamacpp-coefficients-2core.json")]) == 0
    out = json.loads(f.read_text())
    ll = out["rows"]["llama.cpp mmap"]
    assert ll["predicted_terms"]["fault_regime"] == "cyclic"
    t = ll["predicted_terms"]
    assert t["fault_bytes"] == pytest.approx(t["host_read_bytes"], rel=0.01)
    assert ll["predicted_tok_s"] == pytest.approx(src["rows"]["llama.cpp mmap"]["predicted_tok_s"], rel=1e-6)
    assert ll["before_reprice"]["predicted_tok_s"] == pytest.approx(7.5958926896597125)   # kept over re-runs
    nm = out["rows"]["llama.cpp no-mmap"]
    assert nm["predicted_outcome"] == "does not fit (OOM)" and nm["outcome_matches"] is True
    for name in ("ours", "hot-first"):
        assert out["rows"][name]["predicted_tok_s"] == src["rows"][name]["predicted_tok_s"]
    assert "reprice at planner commit" in out["repriced"]["by"]


def test_reprice_missing_file_is_a_usage_error(tmp_path, capsys):
    m = bench("replay_llamacpp")
    with pytest.raises(SystemExit) as e:
        m.main(["reprice", str(tmp_path / "nope.json"), "--fault-probe", "x", "--profile", "y"])
    assert e.value.code == 2 and "no such file" in capsys.readouterr().err


def test_reprice_and_check_refuse_bad_files_and_outputs_that_are_inputs(tmp_path, capsys):
    """Bad JSON, another kind of file, an output that is an input or a folder: a one-line usage error
    (exit 2), nothing written."""
    root = Path(__file__).resolve().parents[1]
    m = bench("replay_llamacpp")
    probe = root / "bench/results/mmap-fault-probe-2core.json"
    prof = root / "tests/data/replay-profile-int8.json"
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    other = root / "tests/data/replay-llamacpp-q4-4gb.json"   # a placements replay, not beyond-ram
    for argv, said in (([str(bad)], "JSONDecodeError"), ([str(other), "--out", str(tmp_path / "o.json")],
                                                         "not a beyond-ram result")):
        with pytest.raises(SystemExit) as e:
            m.main(["reprice", *argv, "--fault-probe", str(probe), "--profile", str(prof)])
        assert e.value.code == 2 and said in capsys.readouterr().err
    src = tmp_path / "r.json"
    src.write_text((root / "bench/results/replay-beyond-ram-2.5gb.json").read_text())
    with pytest.raises(SystemExit) as e:
        m.main(["reprice", str(src), "--fault-probe", str(probe), "--profile", str(prof), "--out", str(prof)])
    assert e.value.code == 2 and "it is the input" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()
    c = bench("replay_check")
    args = [str(root / "tests/data/replay-llamacpp-q8-4gb-r3.json"), "--coefficients",
            str(root / "bench/results/llamacpp-coefficients-2core.json"), "--profile", str(prof), "--model",
            str(root / "tests/data/replay-qwen3-8l.spec.json")]
    assert c.main([*args, "--out", str(tmp_path)]) == 2                       # a folder
    assert c.main([*args, "--out", args[0]]) == 2                             # the replay itself
    assert "it is the input" in capsys.readouterr().err
    assert c.main([*args, "--out", str(tmp_path / "chk.json")]) == 0
    assert json.loads((tmp_path / "chk.json").read_text())["within_20pct"]["decode_tok_s"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "chk.json", "r.json"]   # no temporaries
