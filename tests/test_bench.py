"""The benchmark harness on CPU: a tiny sweep's files agree with each other and with hand counts,
plots render, skips carry reasons, the correctness gate refuses a wrong backend, compare works, and
the configs (presets and the issue's override line) compose."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from sparseflash.bench import BenchConfig, attention_flops, compare_rows, parse_patterns, read_rows, run
from sparseflash.bench import backends as bench_backends
from sparseflash.masks import make

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "seq_lens": [64, 128], "tokens": 256, "hidden": 32, "head_dim": 16, "dtype": "fp32", "block": 32,
    "patterns": ["dense", "causal", "butterfly"],
    "backends": ["sparseflash-blocked", "reference", "sdpa", "flex", "sparseflash-triton"],
    "modes": ["fwd", "fwdbwd"],
    "timing": {"warmup_ms": 1, "rep_ms": 2, "min_repeats": 3, "max_repeats": 5},
    "progress": False, "print_table": False,
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rows = run({**TINY, "out_dir": str(out)})
    return out, rows


def _close(a, b, rel=1e-9):
    return (a != a and b != b) or math.isclose(a, b, rel_tol=rel)


def test_files_agree(tiny_run):
    out, rows = tiny_run
    csv_rows, jsonl_rows = read_rows(out / "results.csv"), read_rows(out / "results.jsonl")
    assert len(rows) == len(csv_rows) == len(jsonl_rows) == 2 * 3 * 2 * 5
    for a, b in zip(csv_rows, jsonl_rows):
        assert set(a) == set(b)
        for key in a:
            if isinstance(a[key], float):
                assert _close(a[key], b[key]), key
            else:
                assert str(a[key]) == str(b[key]), key
    for r in csv_rows:  # the environment is in every row
        assert r["torch"] == torch.__version__ and r["hostname"] and r["timestamp"] and r["device"] == "cpu"
    assert (out / "results.md").read_text().count("|") > 50


def test_derived_columns_recomputed(tiny_run):
    out, _ = tiny_run
    rows = read_rows(out / "results.csv")
    ok = {(r["mode"], r["seq_len"], r["pattern_label"], r["backend"]): r for r in rows if r["status"] == "ok"}
    assert len(ok) == 2 * 3 * 2 * 2  # blocked and reference, every case
    for (mode, s, label, backend), r in ok.items():
        assert r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
        assert _close(r["tflops"], r["flops"] / (r["median_ms"] * 1e-3) / 1e12, 1e-6)
        dense = ok[(mode, s, "dense", backend)]
        assert _close(r["speedup_vs_dense"], dense["median_ms"] / r["median_ms"], 1e-6)
        peer = "reference" if backend == "sparseflash-blocked" else "sparseflash-blocked"
        assert _close(r[f"speedup_vs_{peer}"], ok[(mode, s, label, peer)]["median_ms"] / r["median_ms"], 1e-6)
        assert r["check_against"] == "reference" and r["check_err"] < 1e-4
        assert r["first_call_ms"] > 0 and math.isnan(r["peak_mem_mb"])  # not measured on CPU
        assert r["compiled_kernels"] == r["cached_kernels"] == r["dynamo_graphs"] == 0  # PyTorch's own ops
        expected = attention_flops(r["batch"], r["heads"], s, s, 16, r["density"], mode)
        assert _close(r["flops"], expected)


def test_first_calls_table_summarises_each_backend(tiny_run):
    out, _ = tiny_run
    rows = read_rows(out / "results.csv")
    text = (out / "results.md").read_text()
    table = text[text.index("First calls"):].split("\n\n")[1].splitlines()[2:]
    summary = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in table}
    timed = {b for b in {r["backend"] for r in rows} if any(r["backend"] == b and r["first_call_ms"] > 0 for r in rows)}
    assert set(summary) == timed
    for backend, cells in summary.items():
        seconds = [r["first_call_ms"] / 1e3 for r in rows if r["backend"] == backend and r["first_call_ms"] > 0]
        assert int(cells[0]) == len(seconds)
        assert float(cells[2]) == pytest.approx(max(seconds), rel=1e-2)
        assert [c.strip(" |") for c in cells[3:]] == ["0", "0", "0"]  # PyTorch's own ops compile nothing


def test_compile_counts_count_graphs_and_triton_compiles():
    import triton

    from sparseflash.bench.measure import compile_counts

    heard = []
    triton.knobs.compilation.listener = lambda **kwargs: heard.append(kwargs["cache_hit"])
    try:
        with compile_counts() as counts:
            torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.randn(5))
            for cache_hit in (False, True, False):  # what Triton's compiler tells its listener
                triton.knobs.compilation.listener(src=None, metadata=None, metadata_group=None, times=None,
                                                  cache_hit=cache_hit)
        assert counts == {"compiled_kernels": 2, "cached_kernels": 1, "dynamo_graphs": 1}
        assert heard == [False, True, False]  # a listener set before is still told
    finally:
        triton.knobs.compilation.listener = None


def test_flop_count_by_hand():
    # S=128, D=16, causal with 64-blocks: kept scores = 128*129/2 = 8256 of 128*128 = 16384.
    mask = make("causal", 128, block=64)
    density = 128 * 129 / 2 / 128**2
    assert density == pytest.approx(0.5 + 64 / (2 * 128 * 64) * 1)  # 0.5 + 1/(2*S/... ) = 0.50390625
    assert mask.density == pytest.approx(density, abs=0)
    fwd = 4 * 128 * 128 * 16 * density  # per head, one forward
    assert fwd == 4 * 16 * 8256
    assert attention_flops(2, 3, 128, 128, 16, mask.density, "fwd") == pytest.approx(2 * 3 * fwd)
    assert attention_flops(2, 3, 128, 128, 16, mask.density, "bwd") == pytest.approx(2.5 * 2 * 3 * fwd)
    assert attention_flops(2, 3, 128, 128, 16, mask.density, "fwdbwd") == pytest.approx(3.5 * 2 * 3 * fwd)


def test_flop_column_by_hand(tiny_run):
    out, _ = tiny_run
    r = next(r for r in read_rows(out / "results.csv") if r["seq_len"] == 128 and r["pattern"] == "causal"
             and r["mode"] == "fwdbwd" and r["backend"] == "reference")
    # S=128, block 32: kept = 128*129/2; batch 256//128 = 2, heads 32//16 = 2, D=16, fwd+bwd 3.5x
    assert r["density"] == pytest.approx(8256 / 16384)
    assert r["flops"] == pytest.approx(3.5 * 4 * 8256 * 16 * 2 * 2)


def test_skips_carry_reasons(tiny_run):
    out, _ = tiny_run
    rows = read_rows(out / "results.csv")
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert {r["backend"] for r in skipped} == {"sdpa", "flex", "sparseflash-triton"}
    assert all(r["reason"] for r in skipped) and all(math.isnan(r["median_ms"]) for r in skipped)
    assert any("CUDA" in r["reason"] for r in skipped if r["backend"] == "sparseflash-triton")
    assert "Not timed" in (out / "results.md").read_text()


def test_peer_without_the_mask_is_skipped():
    ctx = bench_backends.Context(torch.device("cuda"))  # as if on a GPU: only the mask decides
    q = torch.randn(1, 2, 128, 16)
    butterfly, causal = make("butterfly", 128, block=32), make("causal", 128, block=32)
    sdpa = bench_backends.REGISTRY["sdpa"]
    assert "dense and causal" in sdpa.skip_reason(q, butterfly, ctx)
    assert sdpa.skip_reason(q, causal, ctx) is None
    assert bench_backends.REGISTRY["flex"].skip_reason(q, butterfly, ctx) is None


@pytest.mark.parametrize("installed", [True, False], ids=["fa4-installed", "fa4-missing"])
def test_flex_flash_is_skipped_where_flashattention4_is_not_installed(installed, monkeypatch):
    """Flex's FLASH backend is in the default runs, as Flex is: on a GPU without FlashAttention-4 its rows are
    skipped with a reason naming the package (not built, not a crash); with it, only the mask and dropout decide."""
    from sparseflash.attention import baselines

    monkeypatch.setattr(baselines, "flash_available", lambda: installed)
    ctx = bench_backends.Context(torch.device("cuda"))
    q, mask = torch.randn(1, 2, 128, 16), make("butterfly", 128, block=32)
    reason = bench_backends.REGISTRY["flex-flash"].skip_reason(q, mask, ctx)
    if installed:
        assert reason is None
    else:
        assert "flash_attn.cute" in reason and "not installed" in reason
        with pytest.raises(baselines.Unsupported, match="not installed"):  # (as the adapter tells a direct caller)
            baselines.flex_attention(q, q, q, mask, backend="FLASH")
    assert "flex-flash" in BenchConfig.from_cfg(_compose([])).backends


def test_plots_render(tiny_run):
    out, _ = tiny_run
    pngs = sorted((out / "plots").glob("*.png"))
    assert {p.name for p in pngs} == {f"{k}_{m}_hd16_fp32.png" for k in ("time", "speedup") for m in ("fwd", "fwdbwd")}
    assert all(p.stat().st_size > 5000 for p in pngs)


def test_gate_refuses_a_wrong_backend(tmp_path, monkeypatch):
    def noisy(q, k, v, mask, ctx, score_mod=None, dropout_p=0.0):
        def fwd():
            return (q + k + v) * 0 + torch.randn_like(q)  # connected to the inputs, wrong values
        return fwd

    wrong = bench_backends.HarnessBackend("noise", noisy, lambda d: "noise")
    monkeypatch.setitem(bench_backends.REGISTRY, "noise", wrong)
    rows = run({**TINY, "seq_lens": [64], "patterns": ["dense", "butterfly"], "modes": ["fwd", "bwd"],
                "backends": ["noise", "sparseflash-blocked"], "out_dir": str(tmp_path)})
    noise = [r for r in rows if r["backend"] == "noise"]
    assert noise and all(r["status"] == "wrong" for r in noise)
    assert all("relative error" in r["reason"] and math.isnan(r["median_ms"]) for r in noise)
    assert all(r["status"] == "ok" for r in rows if r["backend"] == "sparseflash-blocked")
    assert "WRONG" in (tmp_path / "results.md").read_text()


def test_mask_and_score_functions_are_swept_and_checked(tmp_path):
    """Element patterns, ``causal`` and ``score_mod`` in pattern entries: the blocked backend is
    timed and checked against the reference (which runs the same functions); SDPA skips them."""
    patterns = [{"name": "sliding_window", "params": {"window": 20}, "causal": True},
                {"name": "causal", "score_mod": "alibi"},
                {"name": "document", "params": {"documents": 3}, "score_mod": {"name": "softcap", "params": {"cap": 5}}}]
    rows = run({**TINY, "seq_lens": [96], "patterns": patterns, "modes": ["fwdbwd"],
                "backends": ["sparseflash-blocked", "sdpa"], "out_dir": str(tmp_path), "plots": {"enabled": False}})
    labels = {r["pattern_label"] for r in rows}
    assert labels == {"sliding_window(window=20) causal", "causal +alibi", "document(documents=3) +softcap"}
    blocked = [r for r in rows if r["backend"] == "sparseflash-blocked"]
    assert all(r["status"] == "ok" and r["check_against"] == "reference" and r["check_err"] < 1e-4 for r in blocked)
    assert all(r["status"] == "skipped" for r in rows if r["backend"] == "sdpa")
    window = next(r for r in blocked if r["pattern"] == "sliding_window")
    assert window["density"] == pytest.approx(sum(min(i + 1, 20) for i in range(96)) / 96 ** 2)


def test_rows_record_the_tuned_kernel_configs(tmp_path, monkeypatch):
    """A row that runs the Triton kernels names the config each kernel launched with; others leave it empty."""
    from sparseflash.attention import attention
    from sparseflash.attention.triton import tuning

    used = []

    def tuned(q, k, v, mask, ctx, score_mod=None, dropout_p=0.0):  # the blocked kernels' answer, launched through the tuning table
        def fwd():
            for kernel in ("forward", "backward"):
                used.append(tuning.run_tuned(kernel, tuning.ConfigKey.of(q, mask, 16), lambda cfg: None))
            return attention(q, k, v, mask, backend="blocked")
        return fwd

    monkeypatch.setitem(bench_backends.REGISTRY, "tuned", bench_backends.HarnessBackend("tuned", tuned, lambda d: "triton"))
    rows = run({**TINY, "seq_lens": [64], "patterns": ["dense"], "modes": ["fwd"],
                "backends": ["tuned", "sparseflash-blocked"], "out_dir": str(tmp_path), "plots": {"enabled": False}})
    by_backend = {r["backend"]: r for r in rows}
    forward, backward = used[:2]
    expected = (f"forward={forward.block_m}x{forward.block_n}/w{forward.num_warps}/s{forward.num_stages} "
                f"backward={backward.block_m}x{backward.block_n}/w{backward.num_warps}/s{backward.num_stages}")
    assert by_backend["tuned"]["status"] == "ok" and by_backend["tuned"]["kernel_configs"] == expected
    assert by_backend["sparseflash-blocked"]["kernel_configs"] == ""
    assert read_rows(tmp_path / "results.csv")[0]["kernel_configs"] == expected


def test_gate_uses_a_trusted_backend_above_the_reference_limit(tmp_path):
    rows = run({**TINY, "seq_lens": [128], "patterns": ["dense"], "modes": ["fwd"], "backends": ["sparseflash"],
                "check": {"reference_max_gb": 1e-9, "trusted": ["sparseflash-blocked"]}, "out_dir": str(tmp_path),
                "plots": {"enabled": False}})
    assert rows[0]["status"] == "ok" and rows[0]["check_against"] == "sparseflash-blocked"


def test_compare_command(tiny_run, tmp_path, capsys):
    out, _ = tiny_run
    rows = read_rows(out / "results.csv")
    faster = [dict(r, median_ms=r["median_ms"] / 2) for r in rows]
    with open(tmp_path / "b.jsonl", "w") as f:
        for r in faster:
            f.write(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}) + "\n")
    matched, text = compare_rows(rows, read_rows(tmp_path / "b.jsonl"))
    ok = [m for m in matched if m["a_status"] == "ok"]
    assert ok and all(m["speedup"] == pytest.approx(2.0) for m in ok)
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "experiments/bench.py"), "compare", str(out / "results.csv"),
                           str(tmp_path / "b.jsonl"), "--out", str(tmp_path / "cmp.md")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "geometric mean a/b = 2.000" in proc.stdout and (tmp_path / "cmp.md").exists()


def test_wandb_logging_with_a_stub(tmp_path, monkeypatch):
    logged = []

    class Run:
        def log(self, data, step=None):
            logged.append(data)

        def finish(self):
            logged.append("finished")

    stub = types.SimpleNamespace(
        init=lambda **kw: (logged.append(("init", kw["mode"])), Run())[1],
        Table=lambda columns, data: ("table", columns, data),
        Image=lambda path: ("image", path),
        plot=types.SimpleNamespace(line_series=lambda **kw: ("line_series", kw)),
    )
    monkeypatch.setitem(sys.modules, "wandb", stub)
    run({**TINY, "seq_lens": [64, 128], "patterns": ["dense"], "modes": ["fwd"], "backends": ["sparseflash-blocked"],
         "out_dir": str(tmp_path), "logger": {"wandb": {"project": "p", "mode": "offline"}}})
    assert ("init", "offline") in logged and logged[-1] == "finished"
    tables = [d for d in logged if isinstance(d, dict) and "bench/results" in d]
    assert tables and len(tables[0]["bench/results"][2]) == 2
    series = [v for d in logged if isinstance(d, dict) for v in d.values() if isinstance(v, tuple) and v[0] == "line_series"]
    assert series and series[0][1]["xs"] == [[64, 128]]


# ---------------------------------------------------------------------------- configs
def _compose(overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="bench", overrides=overrides)


def test_cases_sweep_decoding_and_gqa_shapes(tmp_path):
    """``cases``: a few queries against a longer GQA cache and an odd square length, checked against
    the reference on whole GQA groups and counted with S_q x S_kv FLOPs."""
    cases = [{"q_len": 3, "kv_len": 200, "head_dim": 16, "heads": 4, "kv_heads": 2, "batch": 2},
             {"q_len": 77, "head_dim": 24}]
    rows = run({**TINY, "cases": cases, "patterns": ["dense", "causal"], "modes": ["fwdbwd"],
                "backends": ["sparseflash-blocked", "sdpa"], "check": {"max_heads": 1},
                "out_dir": str(tmp_path), "plots": {"enabled": False}})
    blocked = [r for r in rows if r["backend"] == "sparseflash-blocked"]
    assert [(r["shape"], r["pattern"]) for r in blocked] == [("3x200 H4/2 B2", "dense"), ("3x200 H4/2 B2", "causal"),
                                                             ("77", "dense"), ("77", "causal")]
    assert all(r["status"] == "ok" and r["check_against"] == "reference" and r["check_err"] < 1e-4 for r in blocked)
    decode = blocked[0]
    assert (decode["seq_len"], decode["kv_len"], decode["heads"], decode["kv_heads"]) == (3, 200, 4, 2)
    assert decode["flops"] == pytest.approx(4 * 2 * 4 * 3 * 200 * 16 * 3.5)
    odd = blocked[2]
    assert (odd["batch"], odd["heads"], odd["kv_heads"], odd["kv_len"]) == (256 // 77, 32 // 24, 32 // 24, 77)
    table = (tmp_path / "results.md").read_text()
    assert "| 3x200 H4/2 B2 | dense |" in table and "| 77 | causal |" in table
    assert [r["shape"] for r in read_rows(tmp_path / "results.csv")][:2] == ["3x200 H4/2 B2"] * 2


def test_padded_batches_are_swept_checked_and_counted(tmp_path, monkeypatch):
    """``key_lengths``: each batch's keys end at a length drawn from [0.5 kv_len, kv_len]; the backends get them,
    the gate checks batch 0's (padded) outputs against the reference with its length, a backend that ignores them
    is refused, and density and FLOPs count the scores computed (``reference.allowed_scores``)."""
    from sparseflash.attention import attention
    from sparseflash.attention.reference import allowed_scores
    from sparseflash.bench.spec import Shape, draw_key_lengths
    from sparseflash.bench.sweep import case_seed

    def unpadded(q, k, v, mask, ctx, score_mod=None, dropout_p=0.0, key_lengths=None):
        return lambda: attention(q, k, v, mask, backend="blocked")

    monkeypatch.setitem(bench_backends.REGISTRY, "unpadded",
                        bench_backends.HarnessBackend("unpadded", unpadded, lambda d: "blocked"))
    cases = [{"q_len": 96, "kv_len": 160, "head_dim": 16, "heads": 2, "batch": 3}]
    rows = run({**TINY, "cases": cases, "key_lengths": 0.5, "patterns": ["dense", "causal", "butterfly"],
                "modes": ["fwd", "fwdbwd"], "backends": ["sparseflash-blocked", "unpadded", "sdpa"],
                "out_dir": str(tmp_path), "plots": {"enabled": False}})
    seed = case_seed(BenchConfig.from_cfg({"cases": cases}), Shape(3, 2, 2, 96, 160, 16))
    lengths = draw_key_lengths(3, 160, 0.5, seed)
    assert lengths.min() >= 80 and lengths[0] == lengths.min() < 160  # batch 0 is padded: the gate sees the padding
    blocked = [r for r in rows if r["backend"] == "sparseflash-blocked"]
    assert len(blocked) == 6 and all(r["status"] == "ok" and r["check_against"] == "reference"
                                     and r["check_err"] < 1e-4 for r in blocked)
    for r in blocked:
        mask = make(r["pattern"], 96, 160, block=32)
        # refused where the padding drops a score of batch 0 (a causal row may end before batch 0's keys do)
        cut = not torch.equal(allowed_scores(mask, lengths[:1], "cpu"), allowed_scores(mask, None, "cpu"))
        assert cut or r["pattern"] == "causal"
        refused = next(u for u in rows if u["backend"] == "unpadded" and (u["pattern"], u["mode"]) ==
                       (r["pattern"], r["mode"]))
        assert refused["status"] == ("wrong" if cut else "ok"), refused
        density = allowed_scores(mask, lengths, "cpu").expand(3, -1, -1, -1).double().mean().item()
        assert r["key_lengths_mean"] == pytest.approx(lengths.double().mean().item())
        assert r["density"] == pytest.approx(density) and r["density"] < mask.density
        assert r["flops"] == pytest.approx(attention_flops(3, 2, 96, 160, 16, density, r["mode"]))
    shape = f"96x160 B3 (keys {lengths.double().mean().item():.0f})"  # a padded shape's label names its keys
    assert {r["shape"] for r in rows} == {shape} and f"| {shape} | butterfly |" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize("value", [0, 1.5, "half", True])
def test_bad_key_lengths_fraction_is_explained(value):
    with pytest.raises(ValueError, match=r"key_lengths must be a fraction in \(0, 1\]"):
        BenchConfig.from_cfg({"key_lengths": value})


def test_the_gate_slices_whole_gqa_groups():
    """The gate's slice keeps whole GQA groups, so that the sliced dK and dV are complete sums: one
    head asked for, its group of two query heads and their one key/value head taken."""
    from sparseflash.bench import measure

    q, do = torch.randn(1, 4, 8, 16), torch.randn(1, 4, 8, 16)
    k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    qs, ks, vs, dos = measure.slice_inputs(q, k, v, do, 1)
    assert (qs.shape[1], ks.shape[1], vs.shape[1], dos.shape[1]) == (2, 1, 1, 2)


@pytest.mark.parametrize("case, message", [({"head_dim": 64}, "a case is"), ({"q_len": 1, "head_dim": 64, "kvlen": 9},
                                                                         "unknown keys"),
                                            ({"q_len": 0, "head_dim": 64}, ">= 1"),
                                            ({"q_len": 1, "head_dim": 64, "heads": 6, "kv_heads": 4}, "multiple")],
                         ids=["no-q_len", "unknown-key", "zero", "bad-gqa"])
def test_bad_cases_are_explained(case, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig.from_cfg({"cases": [case]})


def test_cuda_graph_timing_takes_forward_modes_only():
    with pytest.raises(ValueError, match="timing.cuda_graph times forward calls only"):
        BenchConfig.from_cfg({"modes": ["fwd", "fwdbwd"], "timing": {"cuda_graph": True}})


@pytest.mark.gpu
def test_gpu_cuda_graph_timing_replays_each_backend(tmp_path):
    """``timing.cuda_graph``: decoding rows (host-bound when called eagerly) timed as CUDA graph replays of
    sparseflash's kernels, Flex and SDPA, each checked against the reference first."""
    cases = [{"q_len": 1, "kv_len": 8192, "head_dim": 128, "heads": 8, "kv_heads": 1, "batch": 2},
             {"q_len": 16, "kv_len": 3000, "head_dim": 64, "heads": 16, "kv_heads": 4, "batch": 2}]
    rows = run({"cases": cases, "patterns": ["dense"], "modes": ["fwd"], "dtype": "bf16", "device": "cuda",
                "backends": ["sparseflash-triton", "flex", "sdpa"], "timing": {"rep_ms": 30, "cuda_graph": True},
                "out_dir": str(tmp_path), "plots": {"enabled": False}})
    assert len(rows) == 6
    assert all(r["status"] == "ok" and r["cuda_graph"] and 0 < r["median_ms"] < 1 for r in rows), rows


def test_issue_override_line_composes():
    cfg = _compose(["seq_lens=[1024,4096,16384]", "patterns=[dense,causal,butterfly,local]",
                    "backends=[sparseflash,flex,sdpa]", "modes=[fwd,fwdbwd]", "head_dim=128", "dtype=bf16"])
    spec = BenchConfig.from_cfg(cfg)
    assert spec.seq_lens == [1024, 4096, 16384] and spec.head_dims == [128] and spec.dtypes == ["bf16"]
    assert [p.label for p in spec.patterns] == ["dense", "causal", "butterfly", "local(window=2)"]
    assert spec.backends == ["sparseflash", "flex", "sdpa"] and spec.modes == ["fwd", "fwdbwd"]
    assert spec.heads_for(128) == 16 and spec.batch_for(4096) == 4 and spec.wandb is None


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "configs/bench").glob("*.yaml")))
def test_presets_compose(preset):
    spec = BenchConfig.from_cfg(_compose([f"bench={preset}"]))
    assert spec.seq_lens and spec.patterns and spec.backends


def test_h100_preset_is_the_issue_grid():
    spec = BenchConfig.from_cfg(_compose(["bench=h100"]))
    assert spec.seq_lens == [1024, 4096, 16384] and spec.tokens == 16384 and spec.head_dims == [128]
    assert [p.label for p in spec.patterns] == ["dense", "causal", "butterfly", "local(window=2)",
                                                "random(density=0.25)"]
    assert {"sparseflash-blocked", "flex", "flex-flash", "sdpa", "sparseflash-triton"} == set(spec.backends)


def test_wandb_logger_and_dict_patterns_compose():
    cfg = _compose(["logger=wandb", "patterns=[dense,{name:local,params:{window:4}},{name:random,label:r}]"])
    spec = BenchConfig.from_cfg(cfg)
    assert spec.wandb["mode"] == "offline"
    assert [p.label for p in spec.patterns] == ["dense", "local(window=4)", "r"]
    assert dict(spec.patterns[2].params) == {"density": 0.25}


def test_bad_config_is_explained():
    with pytest.raises(ValueError, match="registered patterns"):
        parse_patterns(["nope"])
    with pytest.raises(ValueError, match="takes parameters"):
        parse_patterns([{"name": "local", "params": {"widow": 2}}])
    with pytest.raises(ValueError, match="unknown benchmark backend"):
        BenchConfig.from_cfg({"backends": ["fast"]})
    with pytest.raises(ValueError, match="unknown mode"):
        BenchConfig.from_cfg({"modes": ["backward"]})
    with pytest.raises(ValueError, match=r"device must be auto, cpu, cuda or cuda:N; got 'gpu'"):
        BenchConfig.from_cfg({"device": "gpu"}).torch_device()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device=cuda but no CUDA device is available"):
            BenchConfig.from_cfg({"device": "cuda"}).torch_device()


def test_dropout_cases_are_timed_unchecked_and_flex_skips_them(tmp_path):
    """A pattern entry's ``dropout`` reaches the backends: rows carry it, are timed without the gate (each
    call draws new outputs), and FlexAttention, which has no dropout, is skipped with that reason."""
    patterns = ["causal", {"name": "causal", "dropout": 0.1}]
    rows = run({**TINY, "seq_lens": [64], "patterns": patterns, "backends": ["sparseflash-blocked", "flex"],
                "modes": ["fwdbwd"], "device": "cpu", "plots": {"enabled": False}, "out_dir": str(tmp_path)})
    dropped = [r for r in rows if r["pattern_label"] == "causal +dropout 0.1"]
    assert [r["dropout_p"] for r in dropped] == [0.1, 0.1]
    ours = next(r for r in dropped if r["backend"] == "sparseflash-blocked")
    assert ours["status"] == "ok" and ours["median_ms"] > 0 and ours["reason"].startswith("unchecked: dropout")
    plain = next(r for r in rows if r["pattern_label"] == "causal" and r["backend"] == "sparseflash-blocked")
    assert plain["status"] == "ok" and plain["check_against"] and plain["dropout_p"] == 0.0
    assert ours["dropout_cost"] == pytest.approx(ours["median_ms"] / plain["median_ms"])
    assert math.isnan(plain["dropout_cost"])
    csv_row = next(r for r in read_rows(tmp_path / "results.csv") if r["pattern_label"] == "causal +dropout 0.1"
                   and r["backend"] == "sparseflash-blocked")
    assert csv_row["dropout_cost"] == pytest.approx(ours["dropout_cost"])
    table = (tmp_path / "results.md").read_text()
    assert f"| fwdbwd | 16 | 64 | causal +dropout 0.1 | {ours['dropout_cost']:.3g}× | — |" in table
    with pytest.raises(ValueError, match="dropout must be a number"):
        parse_patterns([{"name": "causal", "dropout": 1.0}])


def test_flex_skips_dropout_on_cuda_too():
    ctx = bench_backends.Context(torch.device("cuda"))
    q = torch.zeros(1, 1, 64, 16)
    reason = bench_backends.REGISTRY["flex"].skip_reason(q, make("causal", 64, 64, block=32), ctx, None, 0.1)
    assert reason == "FlexAttention has no dropout on the probabilities"
    assert bench_backends.REGISTRY["flex"].skip_reason(q, make("causal", 64, 64, block=32), ctx, None, 0.0) is None
