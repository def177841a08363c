"""CPU-side tests of flash_decode.bench: arguments, shape specs, the default
matrix, bytes and TB/s arithmetic, the summary, the JSON/CSV writers, the plot
and main's table and files (with synthetic data), and `python -m
flash_decode.bench` on a machine without a GPU."""

import csv
import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from conftest import PACKAGE_PARENT, has_extension
from flash_decode import bench
from flash_decode.bench import Shape


def test_parse_int_accepts_k_suffix():
    assert bench.parse_int("32768") == 32768
    assert bench.parse_int("32k") == bench.parse_int("32K") == 32768
    with pytest.raises(ValueError):
        bench.parse_int("k")


def test_parse_shapes_full_spec_and_defaults():
    assert bench.parse_shapes("b=1,hq=32,hkv=8,d=128,L=32768,sq=1") == [Shape(1, 32, 8, 128, 32768, 1)]
    assert bench.parse_shapes("b=4") == [bench.SHAPE_DEFAULTS._replace(b=4)]
    assert bench.parse_shapes(" l=1k , SQ=4 ") == [bench.SHAPE_DEFAULTS._replace(L=1024, sq=4)]


def test_parse_shapes_alternatives_and_several_specs():
    shapes = bench.parse_shapes("b=1/8,L=1k/4k;hq=48,hkv=48,sq=10")
    assert [(s.b, s.L) for s in shapes[:4]] == [(1, 1024), (1, 4096), (8, 1024), (8, 4096)]
    assert shapes[4] == bench.SHAPE_DEFAULTS._replace(hq=48, hkv=48, sq=10)
    assert bench.label(shapes[0]) == "b=1,hq=32,hkv=8,d=128,L=1024,sq=1"
    assert bench.parse_shapes(bench.label(shapes[0])) == [shapes[0]]


@pytest.mark.parametrize("spec", ["x=1", "b", "b=0", "hq=32,hkv=5", "b=one"])
def test_parse_shapes_rejects_bad_specs(spec):
    with pytest.raises(ValueError):
        bench.parse_shapes(spec)


def test_parse_args_defaults_to_the_matrix():
    args = bench.parse_args([])
    assert args.cases == bench.matrix_cases(bench.DEFAULT_MATRIX)
    assert args.peers == list(bench.PEERS) and args.repeats == 20 and not args.no_plot
    assert args.layout == "bhsd"
    quick = bench.parse_args(["--quick"]).cases
    assert 3 <= len(quick) <= 8 and {dt for _, dt in quick} == {"fp16", "bf16"}


def test_parse_args_options():
    args = bench.parse_args(["--shapes", "b=2,L=2k", "--shapes", "b=3;b=4", "--dtypes", "fp16,bf16",
                             "--peers", "cudnn,flex", "--repeats", "5", "--out", "/tmp/x", "--no-plot"])
    assert [(s.b, dt) for s, dt in args.cases] == [
        (2, "fp16"), (2, "bf16"), (3, "fp16"), (3, "bf16"), (4, "fp16"), (4, "bf16")]
    assert args.peers == ["cudnn", "flex"] and args.repeats == 5 and args.no_plot
    assert str(args.out) == "/tmp/x"
    assert bench.parse_args(["--peers", "none"]).peers == []
    assert {dt for _, dt in bench.parse_args(["--dtypes", "bf16"]).cases} == {"bf16"}
    assert args.num_splits == [] and bench.parse_args(["--num-splits", "0,1,16"]).num_splits == [0, 1, 16]
    assert not args.read_same_bytes and bench.parse_args(["--read-same-bytes"]).read_same_bytes
    assert args.settle == bench.SETTLE_S and bench.parse_args(["--settle", "0"]).settle == 0


@pytest.mark.parametrize("argv", [["--peers", "cudnn,magic"], ["--dtypes", "fp8"], ["--shapes", "q=1"],
                                  ["--num-splits", "1,x"], ["--num-splits", "-1"], ["--num-splits", ","],
                                  ["--settle", "-1"], ["--settle", "nan"], ["--settle", "inf"], ["--settle", "soon"],
                                  ["--repeats", "0"], ["--repeats", "-3"], ["--repeats", "2.5"]])
def test_parse_args_errors_exit(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_default_matrix_is_a_cross_section():
    cases = bench.matrix_cases(bench.DEFAULT_MATRIX)
    shapes = [s for s, _ in cases]
    assert len(cases) == len(set(cases)) and 20 <= len(cases) <= 36  # a cross-section, ~4 minutes
    assert min(s.b for s in shapes) == 1 and max(s.b for s in shapes) == 256
    assert {(32, 32), (32, 8), (64, 8), (48, 48), (8, 1)} <= {(s.hq, s.hkv) for s in shapes}
    assert {s.sq for s in shapes if (s.hq, s.hkv) == (48, 48)} == {1, 10}
    assert {64, 128, 256} == {s.d for s in shapes}
    assert min(s.L for s in shapes) == 1024 and max(s.L for s in shapes) == 131072
    assert {1, 4} <= {s.sq for s in shapes}
    assert {dt for _, dt in cases} == {"fp16", "bf16"}
    assert Shape(1, 32, 8, 128, 1024, 1) in shapes  # the smallest 32/8 d128 call
    assert max(bench.kv_bytes(s, dt) for s, dt in cases) < 8e9  # fits 3 layers in 40% of 141 GB
    mb = [bench.kv_bytes(s, dt) / bench.MB for s, dt in cases]
    assert any(m >= 256 for m in mb) and any(64 <= m < 256 for m in mb) and any(m <= 32 for m in mb)


def test_matrix_cases_dtype_override_dedups_shapes():
    matrix = [("fp16", "b=1"), ("bf16", "b=1;b=2")]
    assert bench.matrix_cases(matrix) == [(Shape(1, 32, 8, 128, 32768, 1), "fp16"),
                                          (Shape(1, 32, 8, 128, 32768, 1), "bf16"),
                                          (Shape(2, 32, 8, 128, 32768, 1), "bf16")]
    assert [(s.b, dt) for s, dt in bench.matrix_cases(matrix, ["bf16"])] == [(1, "bf16"), (2, "bf16")]


def test_bytes_and_bandwidth_arithmetic():
    shape = Shape(b=1, hq=32, hkv=8, d=128, L=32768, sq=1)
    assert bench.kv_bytes(shape, "fp16") == bench.kv_bytes(shape, "bf16") == 2 * 32768 * 8 * 128 * 2
    assert bench.kv_bytes(shape._replace(b=4, hq=8, hkv=1), "fp16") == 4 * 2 * 32768 * 1 * 128 * 2
    assert bench.tbs(134217728, 30.0) == pytest.approx(4.474, abs=1e-3)  # bytes / µs / 1e6
    assert bench.geomean([1.0, 4.0]) == pytest.approx(2.0) and bench.geomean([]) is None


def test_layer_count_rotates_past_l2_within_memory():
    free = 140e9
    assert bench.layer_count(4 * 2**20, free) == math.ceil(240e6 / (4 * 2**20))  # 58 small caches
    assert bench.layer_count(2e9, free) == 3                                      # at least 3
    assert bench.layer_count(20e9, free) == 2                                     # 40% of free caps
    assert bench.layer_count(100e9, free) == 0                                    # does not fit
    assert bench.layer_count(4 * 2**20, free, 20e9) == 2   # small reads of large layers: memory caps


def row(b=1, L=32768, dtype="fp16", ours=30.0, kv_mb=134.0, sweep_us=None, **peers):
    """A synthetic result row; peers as name=µs."""
    r = dict(dtype=dtype, b=b, hq=32, hkv=8, d=128, L=L, sq=1, kv_mb=kv_mb, layers=3, num_splits=66,
             kernel="k", check="ok", ours_us=ours, ours_tbs=kv_mb / ours, ours_pct=90.0)
    if sweep_us:
        r["sweep_us"] = sweep_us
    for name, us in peers.items():
        r.update({f"{name}_us": us, f"{name}_tbs": kv_mb / us, f"{name}_ratio": us / ours,
                  f"{name}_note": "gqa"})
    return r


def test_summarize_ratios_shares_and_eager():
    big = row(ours=30.0, cudnn=40.0, flash=60.0, kv_mb=300.0) | {"ours_pct": 98.0, "read_us": 29.0, "read_pct": 99.0}
    small = row(L=1024, ours=5.0, cudnn=4.0, kv_mb=4.19) | {"ours_pct": 50.0}
    mid = row(L=8192, ours=20.0, cudnn=30.0, kv_mb=100.0) | {"ours_pct": 80.0}
    failed = {k: v for k, v in row(kv_mb=100.0).items() if not k.startswith("ours")} | {"check": "MISMATCH: 1"}
    eager = dict(shape="b=1,hq=32,hkv=8,d=128,L=256,sq=1", ours_us=3.0, sdpa_us=10.0, ratio=0.3)
    summary = bench.summarize([big, small, mid, failed], eager)
    assert all(isinstance(what, str) and isinstance(value, str) for what, value in summary)
    s = dict(summary)
    assert s["checked against fp32 SDPA"] == "3/4 ok"
    # cuDNN's time / flash_decode's: 40/30, 4/5, 30/20; geomean (1.333 * 0.8 * 1.5) ** (1/3)
    assert s["vs cudnn (its time / flash_decode's)"] == "min 0.800x, geomean 1.170x, max 1.500x over 3 shapes"
    assert s["vs flash (its time / flash_decode's)"] == "2.000x (1 shape)"
    assert s["vs a plain read of the same bytes (its time / flash_decode's)"] == "0.967x (1 shape)"
    assert "vs efficient (its time / flash_decode's)" not in s and "vs flex (its time / flash_decode's)" not in s
    assert s["flash_decode, caches < 64 MB: share of the read ceiling"] == "50.0% (1 shape)"
    assert s["flash_decode, caches 64-256 MB: share of the read ceiling"] == "80.0% (1 shape)"
    assert s["flash_decode, caches >= 256 MB: share of the read ceiling"] == "98.0% (1 shape)"
    assert s["plain read, caches >= 256 MB: share of the read ceiling"] == "99.0% (1 shape)"
    assert "plain read, caches < 64 MB: share of the read ceiling" not in s
    # The plain read's time over flash_decode's, where both were timed: 29/30.
    assert s["flash_decode, caches >= 256 MB: share of the plain read's speed"] == "96.7% (1 shape)"
    assert "flash_decode, caches < 64 MB: share of the plain read's speed" not in s
    assert s["eager call on b=1,hq=32,hkv=8,d=128,L=256,sq=1"] == \
        "flash_decode 3.0 us, torch SDPA 10.0 us (0.300x)"
    two = dict(bench.summarize([big | {"ours_pct": 90.0}, mid | {"kv_mb": 400.0}], None))
    assert two["flash_decode, caches >= 256 MB: share of the read ceiling"] == \
        "min 80.0%, median 85.0%, max 90.0% over 2 shapes"
    # No verdicts against fixed targets: the summary reports, it does not judge.
    assert not any(word in what + value for what, value in summary for word in ("PASS", "FAIL", "target"))
    assert bench.summarize([], None) == [("checked against fp32 SDPA", "0/0 ok")]


def test_write_results_json_and_csv(tmp_path):
    rows = [row(cudnn=40.0, sweep_us={1: 50.0, 16: 30.25}),
            dict(row(), check="n/a (cache does not fit)", cudnn_note="n/a (why, not)")]
    summary = bench.summarize(rows, None)
    bench.write_results(tmp_path / "o", rows, {"ceiling_tbs": 4.4}, summary, ["cudnn", "flex"])
    data = json.loads((tmp_path / "o" / "results.json").read_text())
    assert data["meta"]["ceiling_tbs"] == 4.4 and data["rows"][0]["cudnn_us"] == 40.0
    assert data["summary"][0] == {"what": "checked against fp32 SDPA", "value": "1/2 ok"}
    with open(tmp_path / "o" / "results.csv", newline="") as f:
        lines = list(csv.DictReader(f))
    assert list(lines[0]) == bench.csv_columns(["cudnn", "flex"])
    assert lines[0]["cudnn_ratio"] == "1.333" and lines[0]["flex_us"] == ""
    assert lines[1]["cudnn_note"] == "n/a (why, not)"
    assert lines[0]["sweep_us"] == "1:50 16:30.25" and lines[1]["sweep_us"] == ""
    assert data["rows"][0]["sweep_us"] == {"1": 50.0, "16": 30.25}


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_layer_bytes_views_each_layers_k_and_v(layout):
    # make_tensors' layout: one buffer (layers, 2, b, ..., d), K then V per layer.
    buf = torch.arange(3 * 2 * 2 * 4 * 5 * 8, dtype=torch.float32).to(torch.float16).view(3, 2, 2, 4, 5, 8)
    kvs = [(buf[i, 0], buf[i, 1]) if layout == "bhsd" else (buf[i, 0].transpose(1, 2), buf[i, 1].transpose(1, 2))
           for i in range(3)]
    views = bench.layer_bytes(kvs, block=64)
    assert len(views) == 3
    for i, x in enumerate(views):
        assert x.shape == (640,) and x.is_contiguous()  # 2 * 320 elements, a multiple of 64
        assert torch.equal(x, buf[i].reshape(-1))
    assert len(bench.layer_bytes(kvs, block=48)[0]) == 624  # cut to whole blocks
    assert bench.layer_bytes(kvs, block=1024) == []  # a layer smaller than one block
    with pytest.raises(ValueError):
        bench.layer_bytes([(buf[0, 0], buf[1, 1])])


def test_format_row_shows_peers_and_na():
    r = row(cudnn=40.0)
    r["flex_note"] = "n/a (too big)"
    text = bench.format_row(r, ["cudnn", "flash", "flex"])
    assert "30.0us" in text and "cudnn 1.33x" in text and "flex n/a (too big)" in text
    assert "splits 2:31.0 4:29.5" in bench.format_row(row(sweep_us={2: 31.0, 4: 29.5}), [])
    assert "read 28.0us 95%" in bench.format_row(row() | {"read_us": 28.0, "read_pct": 95.2}, [])
    assert "splits=66 | 30.0us" in text  # no tail split
    assert "splits=2 after 264 whole | 30.0us" in bench.format_row(row() | {"num_splits": 2, "whole_items": 264}, [])
    bare = {k: v for k, v in r.items() if not k.startswith("ours")} | {"check": "MISMATCH: 1"}
    assert "MISMATCH: 1" in bench.format_row(bare, ["cudnn"])


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [row(b=b, L=L, ours=L / 1000 * b, kv_mb=L * b / 250, cudnn=L / 800 * b, flash=L / 700 * b)
            for b in (1, 8) for L in (1024, 8192, 32768)]
    rows.append(dict(row(b=64), check="n/a (x)"))
    for r in rows[-1:]:
        for k in [k for k in r if k.startswith("ours_")]:
            del r[k]
    path = tmp_path / "bandwidth.png"
    bench.plot(rows, 4.4, path, ["cudnn", "flash", "efficient", "flex"])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_main_without_gpu_exits_cleanly(capsys):
    assert bench.main(["--quick"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def run_bench(*argv):
    """`python -m flash_decode.bench argv...` with every GPU hidden (so it holds on GPU
    machines too), importing this flash_decode."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_PARENT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.run([sys.executable, "-m", "flash_decode.bench", *argv], env=env,
                          capture_output=True, text=True, timeout=120)


def test_module_without_gpu_says_so_in_one_line():
    child = run_bench("--quick")
    assert child.returncode == 2, child.stderr
    assert child.stdout == ""
    lines = child.stderr.splitlines()
    assert len(lines) == 1, child.stderr  # no traceback, no warnings
    assert lines[0].startswith("flash-decode-bench needs an NVIDIA GPU: ")
    assert "built without CUDA" in lines[0] or "is_available() is False" in lines[0]


def test_module_help_speaks_of_the_benchmark_only():
    child = run_bench("--help")
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("usage: flash-decode-bench") and "--read-same-bytes" in child.stdout
    for word in ("issue", "session", "PASS", "FAIL", "target"):
        assert word not in child.stdout and word not in bench.__doc__


def test_settle_frees_then_waits(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(bench.time, "sleep", lambda s: calls.append(("sleep", s)))
    bench.settle(0.25)
    # The memory goes back to the driver first; the pause counts from when the GPU is idle.
    assert calls == ["empty_cache", "synchronize", ("sleep", 0.25)]


@pytest.mark.parametrize("with_tqdm", [True, False])
def test_main_prints_the_table_and_writes_results(tmp_path, monkeypatch, capsys, with_tqdm):
    # main's reporting on CPU: the GPU parts (ceiling, cases, eager call) return synthetic data.
    if with_tqdm:
        pytest.importorskip("tqdm")
    else:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    cases = {1024: row(L=1024, ours=5.0, kv_mb=4.19, cudnn=6.0), 32768: row(ours=30.0, cudnn=36.0)}
    monkeypatch.setattr(bench, "gpu_missing", lambda: None)
    monkeypatch.setattr(bench, "read_ceiling", lambda repeats: {"torch.sum": 4.0, "triton": 4.4})
    monkeypatch.setattr(bench, "settle", lambda seconds: None)
    monkeypatch.setattr(bench, "run_case", lambda shape, dtype, peers, args: dict(cases[shape.L]))
    monkeypatch.setattr(bench, "eager_tiny", lambda: dict(shape="b=1", ours_us=3.0, sdpa_us=9.0, ratio=1 / 3))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")
    out = tmp_path / "bench"
    assert bench.main(["--shapes", "b=1,L=1k/32k", "--peers", "cudnn", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "flash_decode bench on a GPU" in printed and "read ceiling torch.sum 4.00, triton 4.40 TB/s" in printed
    assert "[1/2] fp16 b=1,hq=32,hkv=8,d=128,L=1024,sq=1 4.2MB" in printed and "cudnn 1.20x" in printed
    assert "[2/2] fp16 b=1,hq=32,hkv=8,d=128,L=32768,sq=1" in printed
    assert "vs cudnn (its time / flash_decode's): min 1.200x, geomean 1.200x, max 1.200x over 2 shapes" in printed
    assert "eager call on b=1: flash_decode 3.0 us, torch SDPA 9.0 us (0.333x)" in printed
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["device"] == "a GPU" and data["meta"]["ceiling_tbs"] == 4.4 and len(data["rows"]) == 2
    assert (out / "results.csv").read_text().count("\n") == 3
    if importlib.util.find_spec("matplotlib"):
        assert (out / "bandwidth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in printed


@pytest.mark.parametrize("page, L", [(1, 64), (16, 64), (16, 50)])
def test_serving_dense_gathers_the_pages(page, L):
    # The serving cases check a paged call against one on the same keys gathered contiguous
    # (an L that is not a multiple of the page size: the last page's first keys).
    from serving_ref import make_paged
    k = torch.randn(3, 64, 2, 8)
    v = torch.randn_like(k)
    kp, vp, table = make_paged(k, v, page, generator=torch.Generator().manual_seed(page))
    gk, gv = bench.dense((kp, vp, table), 3, L)
    torch.testing.assert_close(gk, k[:, :L], rtol=0, atol=0)
    torch.testing.assert_close(gv, v[:, :L], rtol=0, atol=0)


def test_serving_dense_slices_a_larger_capacity():
    # A contiguous layer allocated for more keys than it holds is checked on its first L keys.
    k = torch.randn(3, 512, 2, 8)
    gk, gv = bench.dense((k, k + 1, None), 3, 64)
    torch.testing.assert_close(gk, k[:, :64], rtol=0, atol=0)
    torch.testing.assert_close(gv, k[:, :64] + 1, rtol=0, atol=0)


def test_serving_cases_and_shapes():
    assert list(bench.SERVING_CASES) == ["contiguous", "paged16", "paged1", "append", "append+rotary",
                                         "paged16+append", "paged16+append+rotary",
                                         "8x capacity", "8x capacity+max_seqlen_k", "ragged"]
    assert bench.serving_lengths(3, 4096, False) == [4096] * 3
    assert bench.serving_lengths(3, 4096, True) == [4096, 256, 256]
    assert bench.serving_lengths(2, 8, True) == [8, 1]
    assert bench.parse_args([]).serving_shapes == bench.parse_shapes(bench.SERVING_SHAPES)
    assert bench.parse_args(["--quick"]).serving_shapes == bench.parse_shapes(bench.SERVING_QUICK)
    assert bench.parse_args(["--shapes", "b=1"]).serving_shapes == []
    assert bench.parse_args(["--serving-shapes", "none"]).serving_shapes == []
    row = dict(case="paged16", dtype="fp16", **bench.SHAPE_DEFAULTS._asdict(), us=40.0, tbs=3.4,
               vs_contiguous=1.05, check="ok")
    assert bench.format_serving_row(row).endswith("| 40.0us 3.40TB/s | 1.05x contiguous | check ok")


def test_parse_lengths_and_their_even_spread():
    B = bench.Batch
    assert bench.parse_lengths("32768,1024*7; hq=8,hkv=1,d=64:8k*2,0") == [
        B(32, 8, 128, (32768,) + (1024,) * 7), B(8, 1, 64, (8192, 8192, 0))]
    assert bench.even_lengths((32768,) + (1024,) * 7) == (4992,) * 8
    assert bench.even_lengths((10, 0, 1)) == (4, 4, 3)
    for bad in ("1024*0", "-1,5", "abc", "0,0*3", "1024**2", "hq=8:", "hq=12,hkv=8:4k", "b=2:4k", "hkv:4k"):
        with pytest.raises(ValueError):
            bench.parse_lengths(bad)
    assert bench.parse_args([]).lengths == []
    assert bench.parse_args(["--shapes", "none"]).cases == []
    assert bench.parse_args(["--lengths", "4k,1k*3"]).lengths == [B(32, 8, 128, (4096, 1024, 1024, 1024))]
    with pytest.raises(SystemExit):
        bench.parse_args(["--lengths", "4k*x"])


@pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")
def test_lengths_case_times_planned_unbalanced_and_even(monkeypatch):
    # On CPU: flash_decode and the timer are stand-ins that record what each timing asks.
    calls = []

    def fake_decode(q, k, v, **kw):  # right as planned, wrong for the requested count at equal lengths
        calls.append(kw)
        out = bench.lengths_reference(q, k, v, kw["cache_seqlens"].tolist())
        return out + 1 if kw["num_splits"] and len(set(kw["cache_seqlens"].tolist())) == 1 else out

    timings = itertools.cycle([50.0, 150.0, 40.0, 38.0])
    monkeypatch.setattr(bench.flash_decode, "flash_decode", fake_decode)
    monkeypatch.setattr(bench, "time_kernel", lambda call, layers, repeats: (next(timings), "graph"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (1.2e9, 80e9))  # room for 3 layers of 134 MB
    monkeypatch.setattr(bench, "run_flashinfer_lengths",
                        lambda q, layers, lengths, repeats: (float(len(set(lengths))), f"{len(layers)} layers"))
    r = bench.run_lengths_case(bench.Batch(32, 8, 128, (16384, 1024)), repeats=3, peers=("flashinfer",),
                               device="cpu")
    assert (r["flashinfer_us"], r["flashinfer_even_us"], r["flashinfer_note"]) == (2.0, 1.0, "3 layers")
    # The plan for equal lengths at b=2 and 16384 keys balances: n splits each, at most more.
    plan = bench.flash_decode.plan(2, 1, 32, 8, 128, 16384, seqlen=16384, lengths=True, device=-1)
    assert r["balanced"] and r["num_splits"] == plan["balance_splits"] < plan["num_splits"] == r["most_splits"]
    assert (r["us"], r["unbalanced_us"], r["even_us"], r["even_unbalanced_us"]) == (50.0, 150.0, 40.0, 38.0)
    assert r["check"] == "MISMATCH: even_unbalanced max error 1"
    assert r["keys"] == 17408 and r["L"] == 16384 and r["layers"] == 3
    assert r["tbs"] == pytest.approx(17408 * 8 * 128 * 2 * 2 / 50.0 / 1e6)
    assert [c["num_splits"] for c in calls] == [0, r["num_splits"], 0, r["num_splits"]]
    assert all(c["max_seqlen_k"] == 16384 for c in calls)
    assert calls[0]["cache_seqlens"].tolist() == [16384, 1024] and calls[2]["cache_seqlens"].tolist() == [8704] * 2
    line = bench.format_lengths_row(r)
    assert line.startswith(f"lengths b=2,hq=32,hkv=8,d=128 [16384,1024] | 50.0us 1.43TB/s ({r['num_splits']} "
                           f"splits for equal lengths, balanced, at most {r['most_splits']} splits)")
    assert "unbalanced 150.0us | equal lengths 40.0us, unbalanced 38.0us | check MISMATCH" in line
    # A longest length that is not a power of two is planned as the calls are: for the capacity.
    odd = bench.run_lengths_case(bench.Batch(8, 1, 64, (3000, 5)), repeats=3, device="cpu")
    assert odd["L"] == 3000 and odd["check"] == "ok"
    assert odd["num_splits"] == bench.flash_decode.plan(2, 1, 8, 1, 64, 3000, device=-1)["num_splits"]


def gpu_stand_ins(monkeypatch, ceiling=4.4):
    """main's GPU parts as stand-ins: a GPU named "a GPU" with a Triton read ceiling, no pause
    between cases, no eager call."""
    monkeypatch.setattr(bench, "gpu_missing", lambda: None)
    monkeypatch.setattr(bench, "read_ceiling", lambda repeats: {"triton": ceiling})
    monkeypatch.setattr(bench, "settle", lambda seconds: None)
    monkeypatch.setattr(bench, "eager_tiny", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")


def test_main_runs_lengths_alone(tmp_path, monkeypatch, capsys):
    # --shapes none --lengths: no table (and no plot), the batches in the log and results.json.
    gpu_stand_ins(monkeypatch)
    seen = []

    def fake_case(batch, repeats, peers):
        seen.append(batch)
        if len(batch.lengths) == 1:
            raise RuntimeError("out of memory")
        return dict(lengths=",".join(map(str, batch.lengths)), b=len(batch.lengths), hq=batch.hq, hkv=batch.hkv,
                    d=batch.d, us=10.0, tbs=1.0, num_splits=2,
                    balanced=True, most_splits=17, unbalanced_us=20.0, even_us=9.0, even_unbalanced_us=8.5,
                    check="ok")

    monkeypatch.setattr(bench, "run_lengths_case", fake_case)
    out = tmp_path / "bench"
    assert bench.main(["--shapes", "none", "--lengths", "8k,1k*3;hq=8,hkv=1:5", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert seen == [bench.Batch(32, 8, 128, (8192, 1024, 1024, 1024)), bench.Batch(8, 1, 128, (5,))]
    assert ("lengths b=4,hq=32,hkv=8,d=128 [8192,1024,1024,1024] | 10.0us 1.00TB/s (2 splits for equal lengths, "
            "balanced") in printed
    assert "lengths b=1,hq=8,hkv=1,d=128 [5] | n/a (RuntimeError: out of memory)" in printed
    data = json.loads((out / "results.json").read_text())
    assert data["rows"] == [] and [r["b"] for r in data["meta"]["lengths"]] == [4, 1]
    assert not (out / "bandwidth.png").exists()


def peers_with(monkeypatch, module):
    """available_peers() with sys.modules['flashinfer'] set to module (None: not importable)."""
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    bench.import_flashinfer.cache_clear()
    try:
        return bench.available_peers()
    finally:
        monkeypatch.undo()
        bench.import_flashinfer.cache_clear()


def test_peers_offer_flashinfer_only_where_it_imports(monkeypatch):
    assert peers_with(monkeypatch, None) == bench.BASE_PEERS == ("cudnn", "flash", "efficient", "flex")
    assert peers_with(monkeypatch, types.ModuleType("flashinfer")) == bench.BASE_PEERS + ("flashinfer",)
    monkeypatch.setattr(bench, "PEERS", bench.BASE_PEERS + ("flashinfer",))
    assert bench.parse_args([]).peers == [*bench.BASE_PEERS, "flashinfer"]
    assert bench.parse_args(["--peers", "flashinfer"]).peers == ["flashinfer"]
    monkeypatch.setattr(bench, "PEERS", bench.BASE_PEERS)
    assert "flashinfer" not in bench.parse_args([]).peers
    with pytest.raises(SystemExit):
        bench.parse_args(["--peers", "flashinfer"])


def test_flashinfer_peer_without_flashinfer_is_na(monkeypatch):
    monkeypatch.setattr(bench, "import_flashinfer", lambda: None)
    assert bench.run_peer("flashinfer", None, [], None, bench.SHAPE_DEFAULTS, "fp16", 1) == \
        (None, "n/a (flashinfer not installed)")


@pytest.mark.parametrize("L,page,pages,last", [(64, 16, 4, 16), (64, 64, 1, 64), (40, 16, 3, 8)])
def test_paged_indices(L, page, pages, last):
    indptr, indices, last_len = bench.paged_indices(3, L, page)
    assert indptr.dtype == indices.dtype == last_len.dtype == torch.int32
    assert indptr.tolist() == [0, pages, 2 * pages, 3 * pages]
    assert indices.tolist() == list(range(3 * pages))
    assert last_len.tolist() == [last] * 3


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("contiguous", [True, False])
def test_paged_view_holds_the_dense_keys(page, contiguous):
    b, L, hkv, d = 3, 64, 2, 8
    if contiguous:  # bshd: (b, L, hkv, d) itself
        cache = torch.randn(b, L, hkv, d)
    else:  # bhsd: flash_decode's view of a (b, hkv, L, d) buffer
        cache = torch.randn(b, hkv, L, d).transpose(1, 2)
    pages = bench.paged_view(cache, page)
    assert pages.shape == (b * L // page, page, hkv, d) and pages.is_contiguous()
    assert (pages.data_ptr() == cache.data_ptr()) == contiguous  # a free reshape, else a copy
    indptr, indices, last = bench.paged_indices(b, L, page)
    for i in range(b):
        seq = pages[indices[indptr[i]:indptr[i + 1]].long()].flatten(0, 1)
        seq = seq[:len(seq) - page + last[i]]
        torch.testing.assert_close(seq, cache[i], rtol=0, atol=0)
    with pytest.raises(ValueError):
        bench.paged_view(torch.randn(b, 40, hkv, d), 16)


def test_causal_reference_ends_at_the_last_key():
    # FlashInfer's prefill rows: query i of sq sees keys [0, L - sq + i].
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    got = bench.reference(q, k, v, causal=True)
    for i in range(3):
        want = bench.reference(q[:, :, i:i + 1], k[:, :, :8 + i], v[:, :, :8 + i])
        torch.testing.assert_close(got[:, :, i:i + 1], want)
    torch.testing.assert_close(bench.reference(q[:, :, :1], k, v, causal=True), bench.reference(q[:, :, :1], k, v))
    assert not torch.allclose(got, bench.reference(q, k, v))


def test_flashinfer_in_csv_summary_and_table(tmp_path):
    rows = [row(cudnn=40.0, flashinfer=33.0), row(L=1024, ours=5.0, kv_mb=4.19, flashinfer=4.0)]
    rows[0]["flashinfer_note"] = "page16, tensor cores, graph"
    s = dict(bench.summarize(rows, None))
    assert s["vs flashinfer (its time / flash_decode's)"] == \
        "min 0.800x, geomean 0.938x, max 1.100x over 2 shapes"  # (1.1 * 0.8) ** 0.5
    peers = ["cudnn", "flashinfer"]
    assert bench.csv_columns(peers)[-4:] == ["flashinfer_us", "flashinfer_tbs", "flashinfer_ratio", "flashinfer_note"]
    bench.write_results(tmp_path, rows, {}, list(s.items()), peers)
    with open(tmp_path / "results.csv", newline="") as f:
        lines = list(csv.DictReader(f))
    assert lines[0]["flashinfer_us"] == "33" and lines[0]["flashinfer_ratio"] == "1.1"
    assert lines[0]["flashinfer_note"] == "page16, tensor cores, graph" and lines[1]["cudnn_us"] == ""
    assert "flashinfer 1.10x" in bench.format_row(rows[0], peers)
    if importlib.util.find_spec("matplotlib"):
        bench.plot(rows, 4.4, tmp_path / "bandwidth.png", peers)
        assert (tmp_path / "bandwidth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class FakeFlashInfer(types.ModuleType):
    """A CPU stand-in for flashinfer's paged wrappers: it gathers each sequence's pages
    and runs SDPA (causal as planned); cost() is the time the fake timer reports.
    One variant (one page per sequence, tensor cores) is made wrong and fastest."""

    def __init__(self):
        super().__init__("flashinfer")
        self.plans = []
        fake = self

        class Wrapper:
            def __init__(self, workspace, layout, use_tensor_cores=False):
                assert layout == "NHD" and workspace.dtype == torch.uint8
                self.tc = use_tensor_cores

            def plan(self, *args, causal=False, q_data_type=None, kv_data_type=None):
                *qo, self.indptr, self.indices, self.last, self.hq, self.hkv, self.d, self.page = args
                self.causal = causal
                fake.plans.append((type(self).__name__, self.page, self.tc, causal))

            def run(self, q, kv):
                b = len(self.indptr) - 1
                qq = q.view(b, -1, self.hq, self.d).transpose(1, 2).float()
                outs = []
                for i in range(b):  # sequence i: its pages, the last one filled to last[i] keys
                    pages = self.indices[self.indptr[i]:self.indptr[i + 1]].long()
                    n = (len(pages) - 1) * self.page + int(self.last[i])
                    k, v = (bench.gather_pages(x, pages[None])[0, :n].transpose(0, 1)[None].float() for x in kv)
                    outs.append(bench.reference(qq[i:i + 1], k, v, nb=1, causal=self.causal))
                out = torch.cat(outs)
                whole = len(self.indices) == b  # one page per sequence
                if self.tc and whole:
                    out = out * 2
                fake.last = (10 if self.tc else 12) - (self.page == 16) - 8 * (whole and self.tc)
                return out.transpose(1, 2).reshape(q.shape).to(q.dtype)

        self.BatchDecodeWithPagedKVCacheWrapper = type("Decode", (Wrapper,), {})
        self.BatchPrefillWithPagedKVCacheWrapper = type("Prefill", (Wrapper,), {})


def test_lengths_reference_attends_each_sequence_over_its_own_keys():
    q, k, v = torch.randn(3, 1, 4, 8), torch.randn(3, 6, 2, 8), torch.randn(3, 6, 2, 8)
    out = bench.lengths_reference(q.half(), k.half(), v.half(), [6, 3, 0])
    for i, n in enumerate([6, 3]):
        kk, vv = (x.half().float()[i, :n].repeat_interleave(2, dim=1) for x in (k, v))  # (n, hq, d)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q.half().float()[i, 0], kk) / 8 ** 0.5, dim=-1)
        torch.testing.assert_close(out[i, 0], torch.einsum("hn,nhd->hd", p, vv), rtol=1e-5, atol=1e-5)
    assert out.shape == q.shape and not out[2].any()  # no keys: zeros, as flash_decode writes


def test_ragged_paged_indices():
    # Sequence i owns pages [i * 3, i * 3 + 3) of a 48-key capacity; it uses as many as its keys fill.
    indptr, indices, last = bench.ragged_paged_indices([40, 16, 1], 48, 16)
    assert indptr.tolist() == [0, 3, 4, 5] and indices.tolist() == [0, 1, 2, 3, 6] and last.tolist() == [8, 16, 1]
    for got, want in zip(bench.ragged_paged_indices([64] * 3, 64, 16), bench.paged_indices(3, 64, 16)):
        assert torch.equal(got, want)
    indptr, indices, last = bench.ragged_paged_indices([40, 16, 1], 48, 48)  # one page per sequence
    assert indptr.tolist() == [0, 1, 2, 3] and indices.tolist() == [0, 1, 2] and last.tolist() == [40, 16, 1]


def test_flashinfer_on_ragged_lengths_reports_the_fastest_matching_variant(monkeypatch):
    fake = FakeFlashInfer()
    monkeypatch.setattr(bench, "import_flashinfer", lambda: fake)
    monkeypatch.setattr(bench, "FLASHINFER_WORKSPACE", 64)
    monkeypatch.setattr(bench, "time_kernel", lambda call, layers, repeats: (call(layers[0]) is not None and fake.last,
                                                                             "graph"))
    q = torch.randn(2, 1, 4, 8).half()
    layers = [(torch.randn(2, 32, 2, 8).half(), torch.randn(2, 32, 2, 8).half()) for _ in range(3)]
    us, note = bench.run_flashinfer_lengths(q, layers, (32, 5), 1)
    assert [(p[1], p[2]) for p in fake.plans] == [(16, False), (16, True), (32, False), (32, True)]
    assert (us, note) == (9, "page16, tensor cores, graph")  # the wrong, faster variant is left out
    assert bench.run_flashinfer_lengths(q, layers, (32, 0), 1) == (None, "n/a (a sequence without keys)")
    monkeypatch.setattr(bench, "import_flashinfer", lambda: None)
    assert bench.run_flashinfer_lengths(q, layers, (32, 5), 1) == (None, "n/a (flashinfer not installed)")
    r = dict(lengths="32,5", b=2, hq=4, hkv=2, d=8, us=5.0, tbs=1.0, num_splits=2, balanced=False, most_splits=2,
             unbalanced_us=5.0, even_us=4.0, even_unbalanced_us=4.0, check="ok", flashinfer_us=9.0,
             flashinfer_note="page16, tensor cores, graph", flashinfer_even_us=None,
             flashinfer_even_note="n/a (flashinfer not installed)")
    assert bench.format_lengths_row(r).endswith(
        "| FlashInfer 9.0us (page16, tensor cores, graph), equal lengths n/a (flashinfer not installed)")


@pytest.mark.parametrize("sq", [1, 3])
def test_run_flashinfer_reports_the_fastest_matching_variant(monkeypatch, sq):
    fake = FakeFlashInfer()
    monkeypatch.setattr(bench, "import_flashinfer", lambda: fake)
    monkeypatch.setattr(bench, "FLASHINFER_WORKSPACE", 64)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**12, 10**12))
    monkeypatch.setattr(bench, "time_kernel",  # the variant's own cost, from its first layer
                        lambda call, layers, repeats: (call(layers[0]) is not None and fake.last, "graph"))
    shape = Shape(b=2, hq=4, hkv=2, d=8, L=32, sq=sq)
    q = torch.randn(2, 4, sq, 8).half()
    buf = torch.randn(3, 2, 2, 2, 32, 8).half()  # bhsd layers: the paged views are copies
    kvs = [(buf[i, 0], buf[i, 1]) for i in range(3)]
    ref = bench.reference(q, *kvs[0])  # non-causal, as the other peers get it
    us, note = bench.run_peer("flashinfer", q, kvs, ref, shape, "fp16", 1)
    if sq == 1:
        assert [(p[0], p[1], p[2]) for p in fake.plans] == [
            ("Decode", 16, False), ("Decode", 16, True), ("Decode", 32, False), ("Decode", 32, True)]
        assert (us, note) == (9, "page16, tensor cores, graph")  # the wrong, faster variant is left out
    else:
        assert fake.plans == [("Prefill", 16, False, True), ("Prefill", 32, False, True)]
        assert (us, note) == (11, "page16, causal prefill, graph")
    monkeypatch.setattr(bench, "matches", lambda out, ref, dtype: (False, 1.0))
    assert bench.run_peer("flashinfer", q, kvs, ref, shape, "fp16", 1)[1].startswith("n/a (page16")


# ---- fp8 caches, sinks, the serving matrix ----

def test_parse_args_kv_dtype_runs_the_fp8_matrix():
    args = bench.parse_args(["--kv-dtype", "fp8_e4m3"])
    assert args.kv_dtype == "fp8_e4m3" and args.cases == bench.matrix_cases(bench.FP8_MATRIX)
    assert args.serving_shapes == [] and args.serving_cases == []
    assert bench.parse_args([]).kv_dtype is None and not bench.parse_args([]).paged16
    assert bench.parse_args(["--kv-dtype", "fp8_e5m2", "--quick"]).cases == bench.matrix_cases(bench.FP8_QUICK)
    shaped = bench.parse_args(["--kv-dtype", "fp8_e5m2", "--shapes", "b=2", "--paged16", "--sinks"])
    assert [s.b for s, _ in shaped.cases] == [2] and shaped.paged16 and shaped.sinks
    with pytest.raises(SystemExit):
        bench.parse_args(["--kv-dtype", "fp8"])


def test_fp8_matrix_decodes_one_token_from_4_mb_to_1_gb():
    cases = bench.matrix_cases(bench.FP8_MATRIX)
    assert len(cases) == len(set(cases)) and 12 <= len(cases) <= 20
    assert {s.sq for s, _ in cases} == {1}  # FlashInfer's decode wrapper on every shape
    assert {dt for _, dt in cases} == {"fp16", "bf16"} and {64, 128, 256} == {s.d for s, _ in cases}
    mb = [bench.kv_bytes(s, dt, "fp8_e4m3") / bench.MB for s, dt in cases]
    assert min(mb) < 16 and max(mb) < 1100 and sum(m >= 512 for m in mb) >= 3  # the 95% band has shapes
    assert all(bench.kv_bytes(s, dt, "fp8_e5m2") * 2 == bench.kv_bytes(s, dt) for s, dt in cases)
    # each shape's fp16 size is at least 256 MB somewhere (the 0.55x target's range)
    assert sum(bench.kv_bytes(s, dt) >= 256e6 for s, dt in cases) >= 6


def test_shuffled_pages_deal_a_permutation_to_both_tables():
    lengths, page = [40, 16, 1, 17], 16
    table, (indptr, indices, last) = bench.shuffled_pages(lengths, page, torch.Generator().manual_seed(3))
    assert table.dtype == indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert sorted(indices.tolist()) == list(range(7))  # every page of the pool once
    assert indptr.tolist() == [0, 3, 4, 5, 7] and last.tolist() == [8, 16, 1, 1] and table.shape == (4, 3)
    for i, n in enumerate([3, 1, 1, 2]):  # flash_decode's row i holds FlashInfer's pages of sequence i
        assert table[i, :n].tolist() == indices[indptr[i]:indptr[i + 1]].tolist()
        assert not table[i, n:].any()
    again = bench.shuffled_pages(lengths, page, torch.Generator().manual_seed(3))[0]
    assert torch.equal(table, again)  # seeded
    shuffles = {tuple(bench.shuffled_pages([16] * 8, 1, torch.Generator().manual_seed(s))[1][1].tolist())
                for s in range(4)}
    assert len(shuffles) == 4 and tuple(range(128)) not in shuffles  # shuffled, per seed
    table, (indptr, indices, last) = bench.shuffled_pages([3, 1], 1)
    assert last.tolist() == [1, 1] and indptr.tolist() == [0, 3, 4] and sorted(indices.tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="no keys"):
        bench.shuffled_pages([5, 0], 16)


def test_ragged_lengths_are_seeded_and_in_range():
    a = bench.ragged_lengths(256, 128, 2048, seed=0)
    assert a == bench.ragged_lengths(256, 128, 2048, seed=0) != bench.ragged_lengths(256, 128, 2048, seed=1)
    assert len(a) == 256 and min(a) >= 128 and max(a) <= 2048 and len(set(a)) > 100
    assert min(a) < 300 and max(a) > 1900  # spread over the range, ends included
    assert bench.ragged_lengths(3, 32768, 32768, seed=5) == [32768] * 3


def test_attended_bytes_count_keys_held_not_pages():
    assert bench.attended_bytes([100, 28], 8, 128, 1) == 2 * 128 * 8 * 128
    assert bench.attended_bytes([100, 28], 8, 128, 2) == 2 * bench.attended_bytes([100, 28], 8, 128, 1)
    shape = Shape(b=4, hq=32, hkv=8, d=64, L=1000, sq=1)
    assert bench.attended_bytes([1000] * 4, 8, 64, 2) == bench.kv_bytes(shape, "fp16") == \
        2 * bench.kv_bytes(shape, "bf16", "fp8_e4m3")


def test_parse_serving_ranges_and_errors():
    got = bench.parse_serving("b=8,L=2k-8k; hq=8,hkv=1,b=16,L=4k;b=1/2,d=256,L=100-1536")
    assert got == [bench.Serving(Shape(8, 32, 8, 128, 8192, 1), 2048),
                   bench.Serving(Shape(16, 8, 1, 128, 4096, 1), 4096),
                   bench.Serving(Shape(1, 32, 8, 256, 1536, 1), 100), bench.Serving(Shape(2, 32, 8, 256, 1536, 1), 100)]
    assert bench.serving_label(got[0]) == "32/8 d128 b=8 L=2048-8192" and bench.serving_label(got[1]).endswith("L=4096")
    for bad in ("b=8,L=8k-2k", "b=8,L=0-5", "b=8,L=1k,sq=2", "b=8,L=1k-x", "q=1"):
        with pytest.raises(ValueError):
            bench.parse_serving(bad)


def test_serving_matrix_covers_the_issue_shapes():
    args = bench.parse_args(["--serving-matrix"])
    cases = args.serving_cases
    assert cases == bench.serving_cases(bench.SERVING_MATRIX) and args.cases == [] == args.serving_shapes  # alone
    with_table = bench.parse_args(["--serving-matrix", "--shapes", "b=2"])
    assert with_table.serving_cases == cases and [s.b for s, _ in with_table.cases] == [2]
    assert 12 <= len(cases) <= 16 and len(set(cases)) == len(cases)
    shapes = [s.shape for s, _, _ in cases]
    assert {64, 128, 256} == {s.d for s in shapes}
    assert {1, 4, 8} <= {s.hq // s.hkv for s in shapes} and any(s.hkv == 1 for s in shapes)  # GQA 1/4/8, MQA
    assert min(s.b for s in shapes) == 1 and max(s.b for s in shapes) == 256
    assert {dt for _, dt, _ in cases} == {"fp16", "bf16"} and "fp8_e4m3" in {kv for _, _, kv in cases}
    assert sum(s.lo < s.shape.L for s, _, _ in cases) >= 10  # ragged
    assert bench.Serving(Shape(8, 16, 8, 256, 8192, 1), 2048) in [s for s, _, _ in cases]  # the d256 loss
    assert all(bench.kv_bytes(s.shape, "fp16") < 4.5e9 for s, _, _ in cases)
    quick = bench.parse_args(["--serving-matrix", "--quick"]).serving_cases
    assert quick == bench.serving_cases(bench.SERVING_MATRIX_QUICK) and len(quick) <= 4
    own = bench.parse_args(["--serving-matrix", "b=4,L=1k-2k", "--dtypes", "bf16", "--kv-dtype", "fp8_e5m2"])
    assert own.serving_cases == [(bench.Serving(Shape(4, 32, 8, 128, 2048, 1), 1024), "bf16", "fp8_e5m2")]
    assert bench.parse_args([]).serving_cases == []
    with pytest.raises(SystemExit):
        bench.parse_args(["--serving-matrix", "b=4,L=2k-1k"])


def test_layer_bytes_reads_fp8_bytes_as_fp16_and_cuts_to_attended():
    buf = torch.zeros(3, 2, 4, 64, 2, 8).to(torch.float8_e4m3fn)  # layers, K/V, pages, page, hkv, d
    kvs = [(buf[i, 0], buf[i, 1]) for i in range(3)]
    views = bench.layer_bytes(kvs, block=64)
    assert [v.dtype for v in views] == [torch.float16] * 3 and views[0].numel() == 4 * 64 * 2 * 8  # 2 * K bytes / 2
    assert views[1].data_ptr() == buf[1].data_ptr()
    cut = bench.layer_bytes(kvs, block=64, nbytes=1000)  # 500 fp16 elements, cut to whole blocks
    assert cut[0].numel() == 448 and cut[0].data_ptr() == buf[0].data_ptr()
    half = torch.zeros(3, 2, 4, 64, 2, 8, dtype=torch.float16)
    assert bench.layer_bytes([(half[0, 0], half[0, 1])], block=64, nbytes=1000)[0].numel() == 448


def test_fp8_descales_and_the_values_attended():
    d = bench.fp8_descales(3, 2, "fp8_e4m3", device="cpu")
    assert set(d) == {"k_descale", "v_descale"} and d["k_descale"].shape == (3, 2)
    assert d["k_descale"].dtype == torch.float32 and not torch.equal(d["k_descale"], d["v_descale"])
    lo, hi = bench.DESCALE_RANGE
    assert all(lo <= x <= hi for t in d.values() for x in t.flatten().tolist())
    assert torch.equal(d["k_descale"], bench.fp8_descales(3, 2, "fp8_e5m2", device="cpu")["k_descale"])  # seeded
    assert bench.fp8_descales(3, 2, None) == {}
    x = torch.randn(3, 5, 2, 4).to(torch.float8_e4m3fn)
    got = bench.dequantized(x, d["k_descale"], nb=2)
    assert got.shape == (2, 5, 2, 4) and got.dtype == torch.float32
    torch.testing.assert_close(got[1, :, 0], x[1, :, 0].float() * d["k_descale"][1, 0], rtol=0, atol=0)
    torch.testing.assert_close(bench.dequantized(x, None), x.float(), rtol=0, atol=0)


def test_with_sinks_is_an_extra_logit_without_a_value():
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    sinks = torch.randn(4)
    got = bench.with_sinks(bench.reference(q, k, v), q, k, sinks)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = q @ kk.transpose(-1, -2) / 8 ** 0.5  # (2, 4, 1, 10), then the sink's column, whose value is 0
    p = torch.softmax(torch.cat([s, sinks.view(1, 4, 1, 1).expand(2, 4, 1, 1)], -1), -1)[..., :10]
    torch.testing.assert_close(got, p @ vv, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, bench.reference(q, k, v), atol=1e-3)


def fake_flash_decode(calls):
    """flash_decode on the CPU for run_pool: the keys of each sequence through block_table
    (or a contiguous cache), times the descales, per sequence over cache_seqlens."""
    def fd(q, k_cache, v_cache, *, cache_seqlens, max_seqlen_k, block_table=None, k_descale=None, v_descale=None):
        calls.append(dict(block_table=block_table, max_seqlen_k=max_seqlen_k, fp8=k_descale is not None))
        k, v = bench.dense((k_cache, v_cache, block_table), q.shape[0], max_seqlen_k)
        k, v = bench.dequantized(k, k_descale, len(k)), bench.dequantized(v, v_descale, len(v))
        return bench.lengths_reference(q, k, v, cache_seqlens.tolist()).to(q.dtype)
    return fd


@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
@pytest.mark.parametrize("page", [16, 1, 0])
def test_run_pool_gives_both_libraries_the_same_pages(monkeypatch, page, kv):
    fake, calls = FakeFlashInfer(), []
    monkeypatch.setattr(bench, "import_flashinfer", lambda: fake)
    monkeypatch.setattr(bench, "FLASHINFER_WORKSPACE", 64)
    monkeypatch.setattr(bench, "L2_ROTATION_BYTES", 1)  # 3 layers
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**9, 10**9))
    monkeypatch.setattr(bench.flash_decode, "flash_decode", fake_flash_decode(calls))

    def timed(call, layers, repeats):  # FlashInfer's variants cost what FakeFlashInfer says, flash_decode 7
        fake.last = None
        return call(layers[-1]) is not None and (fake.last or 7.0), "g"
    monkeypatch.setattr(bench, "time_kernel", timed)
    q = torch.randn(3, 1, 4, 16).half()
    lengths = [40, 5, 17]
    r = bench.run_pool(q, lengths, page, 2, "fp16", kv, 3, peers=("flashinfer",), seed=1, read=True)
    assert r["check"] == "ok" and r["us"] == 7.0 and r["layers"] == 3
    assert calls[0]["max_seqlen_k"] == 40 and calls[0]["fp8"] == bool(kv)
    if page:
        assert calls[0]["block_table"].shape == (3, -(-40 // page))
        assert r["fi_note"] == f"page{page}, tensor cores, g" and r["fi_us"] == 10 - (page == 16)
    else:
        assert calls[0]["block_table"] is None and "fi_us" not in r
    # The references come from flash_decode's block_table: FlashInfer matches them only on
    # the same pages, so tables dealt apart leave it n/a.
    real = bench.shuffled_pages
    monkeypatch.setattr(bench, "shuffled_pages", lambda *a: (lambda t, fi: (t.flip(0), fi))(*real(*a)))
    if page:
        r = bench.run_pool(q, lengths, page, 2, "fp16", kv, 3, peers=("flashinfer",), seed=1)
        assert r["check"] == "ok" and r["fi_us"] is None and "mismatch" in r["fi_note"]


def test_run_pool_without_flashinfer_or_room(monkeypatch):
    monkeypatch.setattr(bench, "import_flashinfer", lambda: None)
    monkeypatch.setattr(bench.flash_decode, "flash_decode", fake_flash_decode([]))
    monkeypatch.setattr(bench, "time_kernel", lambda call, layers, repeats: (5.0, "g"))
    monkeypatch.setattr(bench, "L2_ROTATION_BYTES", 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**9, 10**9))
    q = torch.randn(2, 1, 4, 16).half()
    r = bench.run_pool(q, [20, 3], 16, 2, "fp16", None, 3, peers=("flashinfer",))
    assert (r["fi_us"], r["fi_note"]) == (None, "n/a (flashinfer not installed)") and r["us"] == 5.0
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 10**9))
    assert bench.run_pool(q, [20, 3], 16, 2, "fp16", None, 3) == dict(check="n/a (does not fit)")


def serving_row(lo=2048, hi=8192, contiguous=10.0, page16=10.5, fi16=11.0, page1=12.0, fi1=11.9, kv=None):
    r = dict(dtype="fp16", kv_dtype=kv or "fp16", b=8, hq=32, hkv=8, d=128, lo=lo, hi=hi, kv_mb=100.0,
             contiguous_us=contiguous, contiguous_read_us=9.0, contiguous_check="ok")
    for page, us, fi in ((16, page16, fi16), (1, page1, fi1)):
        r.update({f"page{page}_us": us, f"page{page}_vs_contiguous": us / contiguous, f"page{page}_fi_us": fi,
                  f"page{page}_fi_ratio": fi / us, f"page{page}_fi_note": f"page{page}, tensor cores, graph"})
    return r


def test_serving_markdown_and_summary():
    rows = [serving_row(), serving_row(fi16=10.55, kv="fp8_e4m3"), serving_row(lo=32768, hi=32768, fi16=9.0)]
    text = bench.markdown(bench.serving_columns(), rows)
    lines = text.split("\n")
    assert len(lines) == 5 and lines[0].startswith("| dtype | heads q/kv | d | batch | lengths | MB attended |")
    assert lines[2].startswith("| fp16 | 32/8 | 128 | 8 | 2048-8192 | 100.0 | 10.0 | 9.0 | 90% | 10.5 (1.050) |")
    assert "| 1.048 (page16, tensor cores, graph) |" in lines[2]
    assert lines[3].startswith("| fp16 / fp8_e4m3 |") and "| 32768 |" in lines[4]
    s = dict(bench.serving_summary(rows))
    ratios = [11.0 / 10.5, 10.55 / 10.5, 9.0 / 10.5]
    assert s["vs FlashInfer's faster variant, pages of 16 (its time / flash_decode's)"] == \
        f"geomean {math.prod(ratios) ** (1 / 3):.3f}x, min 0.857x; 1 ahead, 1 within ±1%, 1 behind over 3 shapes"
    assert s["pages of 1 over the contiguous cache of the same lengths"] == "median 1.200x, max 1.200x over 3 shapes"
    na = dict(serving_row(), page1_us=None, page1_check="n/a (does not fit)", page1_fi_us=None,
              page1_fi_note="n/a (flashinfer not installed)", page1_vs_contiguous=None, page1_fi_ratio=None)
    line = bench.markdown(bench.serving_columns(), [na]).split("\n")[2]
    assert line.endswith("| n/a (does not fit) | n/a (flashinfer not installed) |")


def test_table_markdown_has_the_fp8_paged_and_sinks_columns_where_measured():
    r = row(cudnn=40.0, flashinfer=33.0)
    r.update(kv_dtype="fp8_e4m3", same_dtype_us=55.0, read_us=28.0, paged16_us=31.0, fi_paged16_us=34.1,
             fi_paged16_note="page16, no tensor cores, graph", sinks_us=30.3,
             flashinfer_note="page16, tensor cores, graph")
    plain = row(L=1024, ours=5.0, kv_mb=4.19)
    cols = bench.table_columns([r, plain], ["cudnn", "flashinfer"])
    heads = [c[0] for c in cols]
    assert heads[:11] == ["dtype", "batch", "heads q/kv", "d", "cache len", "seqlen_q", "cache MB", "splits", "µs",
                          "TB/s", "% ceiling"]
    assert heads[11:] == ["plain read µs", "of the read's speed", "µs, caches in q's dtype", "fp8 / q's dtype",
                          "×cuDNN", "×FlashInfer (its fastest variant)", "shuffled pages of 16 µs",
                          "×FlashInfer there", "with sinks µs", "sinks / without"]
    cells = bench.markdown(cols, [r, plain]).split("\n")[2:]
    assert cells[0].startswith("| fp16 / fp8_e4m3 | 1 | 32/8 | 128 | 32768 | 1 |")
    assert "| **30.0** |" in cells[0] and "| 0.545 |" in cells[0]
    assert "| 1.10 (page16, tensor cores, graph) |" in cells[0]
    assert "| 31.0 | 1.10 (page16, no tensor cores, graph) | 30.3 | 1.010 |" in cells[0]
    assert cells[1].startswith("| fp16 | 1 |") and cells[1].endswith("| – | – | – | – |")
    assert [c[0] for c in bench.table_columns([plain], ["cudnn"])][-1] == "% ceiling"  # nothing optional measured
    s = dict(bench.summarize([r], None))
    assert s["fp8 caches against the same shape in q's dtype (time / time)"] == "0.545x (1 shape)"
    assert s["with sinks against without (time / time)"] == "1.010x (1 shape)"
    assert s["vs FlashInfer on the same shuffled pages of 16 (its time / flash_decode's)"] == "1.100x (1 shape)"


def test_format_row_shows_the_fp8_sinks_and_paged_figures():
    r = row(flashinfer=33.0)
    r.update(kv_dtype="fp8_e4m3", same_dtype_us=55.0, sinks_us=30.3, sinks_check="ok", paged16_us=31.0,
             paged16_check="ok", fi_paged16_us=None, fi_paged16_note="n/a (flashinfer not installed)")
    del r["num_splits"]  # a plan() that does not take the fp8 cache yet
    r["plan_note"] = "n/a (TypeError: kv_dtype)"
    line = bench.format_row(r, ["flashinfer"])
    assert line.startswith("fp16 / fp8_e4m3 b=1,hq=32,hkv=8,d=128,L=32768,sq=1 134.0MB x3 splits=? | 30.0us")
    assert line.endswith("90% | in fp16 55.0us | with sinks 30.3us | shuffled pages of 16 31.0us"
                         " | fi_paged16_note n/a (flashinfer not installed) | plan_note n/a (TypeError: kv_dtype)"
                         " | flashinfer 1.10x")


def test_serving_row_runs_each_pool_on_the_same_lengths(monkeypatch):
    seen = []

    def fake_pool(q, lengths, page, hkv, dtype, kv, repeats, peers=(), seed=0, read=False):
        seen.append((tuple(lengths), page, kv, read, q.shape))
        us = {0: 10.0, 16: 10.4, 1: 12.0}[page]
        return dict(us=us, check="ok", layers=3, **({"fi_us": 11.0, "fi_note": f"page{page}, tensor cores, graph"}
                                                    if page else {"read_us": 9.0}))

    monkeypatch.setattr(bench, "run_pool", fake_pool)
    monkeypatch.setattr(bench, "settle", lambda seconds: None)
    monkeypatch.setattr(torch, "randn", lambda *size, device=None, dtype=None: torch.zeros(size, dtype=dtype))
    args = bench.parse_args(["--shapes", "none", "--serving-matrix", "b=4,L=100-200", "--seed", "7"])
    serving, dtype, kv = args.serving_cases[0]
    r = bench.run_serving_row(serving, dtype, kv, args)
    lengths = tuple(bench.ragged_lengths(4, 100, 200, 7))
    assert seen == [(lengths, 0, None, True, (4, 1, 32, 128)), (lengths, 16, None, False, (4, 1, 32, 128)),
                    (lengths, 1, None, False, (4, 1, 32, 128))]
    assert r["keys"] == sum(lengths) and r["kv_mb"] == round(bench.attended_bytes(lengths, 8, 128, 2) / 1e6, 2)
    assert r["page16_vs_contiguous"] == pytest.approx(1.04) and r["page1_vs_contiguous"] == pytest.approx(1.2)
    assert r["page16_fi_ratio"] == pytest.approx(11 / 10.4) and r["contiguous_read_us"] == 9.0
    assert "contiguous_fi_ratio" not in r and (r["lo"], r["hi"]) == (100, 200)
    line = bench.format_serving_matrix_row(r, serving)
    assert line == ("fp16/fp16 32/8 d128 b=4 L=100-200 | contiguous 10.0us | page16 10.4us, FlashInfer 11.0us "
                    "(1.058x) | page1 12.0us, FlashInfer 11.0us (0.917x) | read 9.0us")


def test_main_runs_the_serving_matrix_alone_and_writes_markdown(tmp_path, monkeypatch, capsys):
    gpu_stand_ins(monkeypatch, ceiling=3.1)
    monkeypatch.setattr(bench, "import_flashinfer", lambda: None)

    def fake_row(serving, dtype, kv, args):
        if serving.shape.b == 2:
            raise RuntimeError("out of memory")
        return serving_row(lo=serving.lo, hi=serving.shape.L, kv=kv)

    monkeypatch.setattr(bench, "run_serving_row", fake_row)
    out = tmp_path / "bench"
    assert bench.main(["--serving-matrix", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    text = (out / "serving.md").read_text()
    assert text in printed + "\n" and not (out / "table.md").exists()
    assert text.startswith("a GPU, torch ") and "FlashInfer: not importable here, so no FlashInfer figures" in text
    assert "| fp16 / fp8_e4m3 | 32/8 | 128 | 8 | 512-4096 |" in text
    assert "[serving 2/3] fp16/fp16 32/8 d128 b=2 L=100-1536 | contiguous n/a (RuntimeError: out of memory)" in printed
    assert "- vs FlashInfer's faster variant, pages of 16 (its time / flash_decode's): geomean 1.048x" in text
    data = json.loads((out / "results.json").read_text())
    assert len(data["meta"]["serving_matrix"]) == 3 and data["meta"]["seed"] == 0


def cpu_case(monkeypatch):
    """run_case on the CPU: 3 layers, its tensors made there, the eager call 1 µs."""
    monkeypatch.setattr(bench, "L2_ROTATION_BYTES", 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**9, 10**9))
    real_randn, real_cache = torch.randn, bench.random_cache
    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **k: real_randn(*a, **k))
    monkeypatch.setattr(bench, "random_cache", lambda size, dt, device="cuda": real_cache(size, dt, "cpu"))
    monkeypatch.setattr(bench, "time_eager", lambda call, layers, calls=50: 1.0)


@pytest.mark.parametrize("kv", [None, "fp8_e4m3"])
def test_run_case_checks_each_library_against_the_values_it_attends(monkeypatch, kv):
    # On the CPU: flash_decode gets the descales (its reference: the values times them),
    # FlashInfer none (its reference: the fp8 values as stored); sinks rescale flash_decode's.
    fake, calls = FakeFlashInfer(), []
    monkeypatch.setattr(bench, "import_flashinfer", lambda: fake)
    monkeypatch.setattr(bench, "FLASHINFER_WORKSPACE", 64)
    cpu_case(monkeypatch)
    monkeypatch.setattr(bench, "settle", lambda seconds: None)

    def timed(call, layers, repeats):
        fake.last = None
        return call(layers[0]) is not None and (fake.last or 20.0 + len(calls) % 2), "graph"

    def fd(q, k, v, *, k_descale=None, v_descale=None, sinks=None, num_splits=0):
        calls.append(dict(descale=k_descale is not None, sinks=sinks is not None, dtype=k.dtype))
        k, v = (bench.dequantized(x, s, len(x)).transpose(1, 2) for x, s in ((k, k_descale), (v, v_descale)))
        out = bench.reference(q.transpose(1, 2), k, v, nb=len(q))
        return (bench.with_sinks(out, q.transpose(1, 2), k, sinks) if sinks is not None else out).transpose(1, 2)

    monkeypatch.setattr(bench, "time_kernel", timed)
    monkeypatch.setattr(bench.flash_decode, "flash_decode", fd)
    argv = ["--shapes", "b=2,hq=4,hkv=2,d=16,L=64", "--sinks", "--peers", "none"] + (["--kv-dtype", kv] if kv else [])
    args = bench.parse_args(argv)
    args.ceiling = 1.0
    r = bench.run_case(args.cases[0][0], "fp16", ["cudnn", "flashinfer"], args)
    assert r["check"] == "ok" and r["sinks_check"] == "ok" and r["sinks_us"] and r["ours_us"]
    assert (r["flashinfer_us"], r["flashinfer_note"]) == (9, "page16, tensor cores, graph")
    assert r["kv_dtype"] == (kv or "fp16") and r["kv_mb"] == round(2 * 2 * 64 * 2 * 16 * (1 if kv else 2) / 1e6, 2)
    assert ("same_dtype_us" in r) == bool(kv) and ("sdpa_eager_us" in r) != bool(kv)
    ours = [c for c in calls if c["dtype"] != torch.float16] if kv else calls
    assert ours and all(c["descale"] == bool(kv) for c in ours) and [c["sinks"] for c in ours].count(True) == 2
    if kv:
        assert r["cudnn_note"] == "n/a (no fp8 cache)" and all(c["dtype"] == torch.float8_e4m3fn for c in ours)
        assert sum(c["dtype"] == torch.float16 for c in calls) == 1  # the same shape in q's dtype, timed


def test_fp8_rows_summarized_against_their_bounds():
    rows = [row(ours=30.0, kv_mb=134.0), row(ours=60.0, kv_mb=600.0), row(ours=5.0, kv_mb=8.0), row(kv_mb=900.0)]
    for r, same, read in zip(rows, (55.0, 115.0, 8.0, None), (28.0, 58.0, 3.0, 29.0)):
        r.update(kv_dtype="fp8_e4m3", same_dtype_us=same, read_us=read)
    rows[3]["kv_dtype"] = "fp16"  # not an fp8 row: no share counted
    s = dict(bench.fp8_bounds(rows))
    assert s["fp8 over q's dtype where that cache is >= 256 MB"] == "max 0.545x over 2 shapes"  # 8 MB's 0.625 left out
    assert s["fp8 caches >= 64 MB: share of the plain read's speed"] == "min 93.3% over 2 shapes"
    assert s["fp8 caches >= 512 MB: share of the plain read's speed"] == "min 96.7% over 1 shape"
    assert bench.fp8_bounds([row()]) == []
    assert ("fp8 caches >= 512 MB: share of the plain read's speed", "min 96.7% over 1 shape") in \
        bench.summarize(rows, None)


def test_time_sinks_catches_a_call_that_drops_them(monkeypatch):
    monkeypatch.setattr(bench, "time_kernel", lambda call, layers, repeats: (call(layers[0]) is not None and 3.0, "g"))
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 512, 16), torch.randn(1, 2, 512, 16)
    ref = bench.reference(q, k, v)

    def call(layer, sinks=None):
        out = bench.reference(q, *layer)
        return (bench.with_sinks(out, q, layer[0], sinks) if sinks is not None else out).transpose(1, 2)

    assert bench.time_sinks(call, [(k, v)], q, k, ref, "fp16", 3) == dict(sinks_check="ok", sinks_us=3.0)
    dropped = bench.time_sinks(lambda layer, sinks=None: call(layer), [(k, v)], q, k, ref, "fp16", 3)
    assert dropped["sinks_check"].startswith("MISMATCH") and "sinks_us" not in dropped


def test_quick_matrices_warm_only_flashinfer_modules_the_full_ones_use():
    # FlashInfer compiles a module per (q dtype, cache dtype, head dim) on first use: a quick
    # run warms modules the full run uses, and nothing else.
    def modules(cases):
        return {(dt, s.d) for s, dt in cases}
    assert modules(bench.matrix_cases(bench.FP8_QUICK)) <= modules(bench.matrix_cases(bench.FP8_MATRIX))
    serving = {(dt, kv, s.shape.d) for s, dt, kv in bench.serving_cases(bench.SERVING_MATRIX)}
    assert {(dt, kv, s.shape.d) for s, dt, kv in bench.serving_cases(bench.SERVING_MATRIX_QUICK)} <= serving
    fp8 = {(dt, "fp8_e4m3", d) for dt, d in modules(bench.matrix_cases(bench.FP8_MATRIX))}
    assert {m for m in serving if m[1]} <= fp8  # the serving matrix's fp8 rows reuse the fp8 table's modules


def test_paged16_columns_hold_every_sequence_whole(monkeypatch):
    seen = []

    def fake_pool(q, lengths, page, hkv, dtype, kv, repeats, peers=(), seed=0, read=False):
        seen.append((q.shape, lengths, page, hkv, dtype, kv, repeats, peers, seed, read))
        return dict(us=31.0, layers=3, check="ok", fi_us=34.0, fi_note="page16, tensor cores, graph")

    monkeypatch.setattr(bench, "run_pool", fake_pool)
    real_randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **k: real_randn(*a, **k))
    args = bench.parse_args(["--kv-dtype", "fp8_e5m2", "--paged16", "--repeats", "4", "--seed", "2"])
    got = bench.paged16_columns(Shape(2, 32, 8, 64, 4096, 1), "bf16", "fp8_e5m2", ["flashinfer"], args)
    assert got == dict(paged16_us=31.0, paged16_layers=3, paged16_check="ok", fi_paged16_us=34.0,
                       fi_paged16_note="page16, tensor cores, graph")
    assert seen == [((2, 1, 32, 64), [4096, 4096], 16, 8, "bf16", "fp8_e5m2", 4, ["flashinfer"], 2, False)]
    assert bench.paged16_columns(Shape(2, 32, 8, 64, 4096, 4), "bf16", None, [], args) == \
        dict(paged16_check="n/a (seqlen_q > 1)")


def test_a_flashinfer_module_that_does_not_build_is_tried_once(monkeypatch):
    fake, tries = FakeFlashInfer(), []
    decode = fake.BatchDecodeWithPagedKVCacheWrapper

    class Unbuilt(decode):
        def plan(self, *args, **kw):
            if self.tc:
                tries.append(kw["kv_data_type"])
                raise RuntimeError("Ninja build failed: fp8 kv with fp16 q" if len(tries) == 1 else "workspace full")
            super().plan(*args, **kw)

    fake.BatchDecodeWithPagedKVCacheWrapper = Unbuilt
    monkeypatch.setattr(bench, "FLASHINFER_UNBUILT", {})
    qo = torch.randn(2, 4, 8).half()
    tables = bench.shuffled_pages([20, 5], 16)[1]
    layers = [(torch.randn(3, 16, 2, 8).half(),) * 2]
    for kv_dt in (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float16, torch.float16):
        workspace = torch.empty(64, dtype=torch.uint8)
        (cc, cc_call, _), (tc, tc_call, _) = bench.flashinfer_decodes(fake, workspace, tables, qo, layers, 16, "page16",
                                                                      kv_dt)
        assert (cc, tc) == ("page16, no tensor cores", "page16, tensor cores") and cc_call(layers[0]).shape == qo.shape
        with pytest.raises(RuntimeError):
            tc_call(layers[0])
    # fp8 built once and failed: not tried again; fp16 failed for another reason each time: tried each time
    assert tries == [torch.float8_e4m3fn, torch.float16, torch.float16]
    assert list(bench.FLASHINFER_UNBUILT.values()) == ["Ninja build failed: fp8 kv with fp16 q"]


# ---- --batch-invariant and --ragged ----

def test_run_case_times_the_invariant_mode_beside_the_default(monkeypatch):
    cpu_case(monkeypatch)
    seen = []

    def fd(q, k, v, *, batch_invariant=False, wrong=False):
        seen.append(batch_invariant)
        out = bench.reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), nb=len(q)).transpose(1, 2)
        return out + (1 if wrong and batch_invariant else 0)

    def timed(call, layers, repeats):
        call(layers[0])
        return (22.0 if seen[-1] else 20.0), "graph"

    monkeypatch.setattr(bench, "time_kernel", timed)
    monkeypatch.setattr(bench.flash_decode, "flash_decode", fd)
    args = bench.parse_args(["--shapes", "b=2,hq=4,hkv=2,d=16,L=64", "--batch-invariant", "--peers", "none"])
    args.ceiling = 1.0
    r = bench.run_case(args.cases[0][0], "fp16", [], args)
    assert (r["check"], r["invariant_check"], r["ours_us"], r["invariant_us"]) == ("ok", "ok", 20.0, 22.0)
    assert not bench.parse_args([]).batch_invariant
    monkeypatch.setattr(bench.flash_decode, "flash_decode", lambda *a, **kw: fd(*a, wrong=True, **kw))
    r = bench.run_case(args.cases[0][0], "fp16", [], args)
    assert r["invariant_check"].startswith("MISMATCH") and "invariant_us" not in r and r["ours_us"] == 20.0


def test_the_invariant_column_summary_and_line():
    big, small = row(ours=30.0, kv_mb=134.0), row(L=1024, ours=5.0, kv_mb=4.19)
    big.update(invariant_us=31.5, invariant_check="ok")
    small.update(invariant_check="MISMATCH: max error 1")
    cols = bench.table_columns([big, small], [])
    assert [c[0] for c in cols][-2:] == ["batch_invariant µs", "invariant / default"]
    cells = bench.markdown(cols, [big, small]).split("\n")[2:]
    assert cells[0].endswith("| 31.5 | 1.050 |") and cells[1].endswith("| MISMATCH: max error 1 | – |")
    s = dict(bench.summarize([big, small], None))
    assert s["batch_invariant=True against the default call (time / time)"] == "1.050x (1 shape)"
    assert s["batch_invariant=True against the default call, caches >= 64 MB (time / time)"] == "1.050x (1 shape)"
    assert "| batch_invariant 31.5us" in bench.format_row(big, [])
    assert "| invariant_check MISMATCH: max error 1" in bench.format_row(small, [])
    assert {"invariant_us", "invariant_check"} <= set(bench.csv_columns([]))


def test_parse_ragged_specs_and_arguments():
    R = bench.Ragged
    assert bench.parse_ragged("b=8,L=4k,sq=8; b=32,hq=8,hkv=1,sq=4-4") == [
        R(Shape(8, 32, 8, 128, 4096, 8), 1), R(Shape(32, 8, 1, 128, 32768, 4), 4)]
    assert bench.ragged_label(R(Shape(8, 32, 8, 128, 4096, 8), 1)) == "32/8 d128 b=8 L=4096 sq=1-8"
    assert bench.ragged_label(R(Shape(8, 32, 8, 128, 4096, 4), 4)) == "32/8 d128 b=8 L=4096 sq=4"
    for bad in ("sq=17", "sq=5-3", "sq=0-2", "b=2,sq=x"):
        with pytest.raises(ValueError):
            bench.parse_ragged(bad)
    args = bench.parse_args(["--ragged"])
    assert args.cases == [] and args.serving_shapes == []  # alone, as --serving-matrix runs
    assert [r for r, _ in args.ragged_cases] == bench.parse_ragged(bench.RAGGED_MATRIX)
    assert {r.lo == r.shape.sq for r, _ in args.ragged_cases} == {True, False}  # mixed batches and uniform ones
    assert len(bench.parse_args(["--ragged", "--quick"]).ragged_cases) == 2
    both = bench.parse_args(["--ragged", "b=4,sq=8", "--shapes", "b=1", "--dtypes", "fp16,bf16"])
    assert both.ragged_cases == [(R(bench.SHAPE_DEFAULTS._replace(b=4, sq=8), 1), "fp16"),
                                 (R(bench.SHAPE_DEFAULTS._replace(b=4, sq=8), 1), "bf16")] and len(both.cases) == 2
    assert bench.parse_args([]).ragged_cases == []
    with pytest.raises(SystemExit):
        bench.parse_args(["--ragged", "sq=20"])


def ragged_stand_in(calls, aligned=True, ragged=True):
    """flash_decode on the CPU for run_ragged_case, per the ragged contract: 4-D q (cache rows by
    cache_batch_idx), or q (total_q, hq, d) with cu_seqlens_q, each sequence's rows causal and
    aligned bottom-right (aligned=False: not causal at all); ragged=False: no such arguments."""
    def fd(q, k, v, *, causal, cu_seqlens_q=None, max_seqlen_q=None, cache_batch_idx=None):
        if cu_seqlens_q is not None and not ragged:
            raise TypeError("flash_decode() got an unexpected keyword argument 'cu_seqlens_q'")
        calls.append(dict(shape=tuple(q.shape), cu=None if cu_seqlens_q is None else cu_seqlens_q.tolist(),
                          max_seqlen_q=max_seqlen_q, idx=None if cache_batch_idx is None else cache_batch_idx.tolist()))
        if cu_seqlens_q is None:
            if cache_batch_idx is not None:
                k, v = k[cache_batch_idx.long()], v[cache_batch_idx.long()]
            return bench.reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), nb=len(q),
                                   causal=causal).transpose(1, 2).to(q.dtype)
        cu = cu_seqlens_q.tolist()
        out = torch.empty_like(q)
        for i, (a, e) in enumerate(zip(cu, cu[1:])):
            out[a:e] = bench.reference(q[a:e].transpose(0, 1)[None], k[i:i + 1].transpose(1, 2),
                                       v[i:i + 1].transpose(1, 2), nb=1, causal=aligned)[0].transpose(0, 1)
        return out
    return fd


def ragged_case(monkeypatch, spec, **stand_in):
    calls = []
    monkeypatch.setattr(bench, "L2_ROTATION_BYTES", 1)  # 3 layers
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**9, 10**9))
    monkeypatch.setattr(bench.flash_decode, "flash_decode", ragged_stand_in(calls, **stand_in))

    def timed(call, layers, repeats):  # the ragged call 10 µs, a call of the whole batch 14, a part of length s 3 + s
        call(layers[0])
        last = calls[-1]
        return (10.0 if last["cu"] else 3.0 + last["shape"][1] if last["idx"] else 14.0), "g"
    monkeypatch.setattr(bench, "time_kernel", timed)
    (ragged,) = bench.parse_ragged(spec)
    return bench.run_ragged_case(ragged, "fp16", 3, seed=5, device="cpu"), calls


def test_ragged_case_times_the_call_beside_its_uniform_parts_and_the_padded_call(monkeypatch):
    r, calls = ragged_case(monkeypatch, "b=6,hq=4,hkv=2,d=16,L=32,sq=5")
    qlens = bench.ragged_lengths(6, 1, 5, 5)
    parts = bench.ragged_parts(qlens)
    assert len(parts) > 1 and sorted(i for seqs in parts.values() for i in seqs) == list(range(6))
    assert r["check"] == "ok" and r["qlens"] == ",".join(map(str, qlens)) and r["total_q"] == sum(qlens)
    ragged, padded, *rest = calls[::2]  # each call checked, then timed
    starts = [0]
    for s in qlens:
        starts.append(starts[-1] + s)
    assert ragged == dict(shape=(sum(qlens), 4, 16), cu=starts, max_seqlen_q=max(qlens), idx=None)
    assert padded == dict(shape=(6, max(qlens), 4, 16), cu=None, max_seqlen_q=None, idx=None)
    assert [(c["shape"][:2], c["idx"]) for c in rest] == [((len(seqs), s), seqs) for s, seqs in parts.items()]
    assert r["parts"] == {s: 3.0 + s for s in parts} and r["parts_us"] == sum(3.0 + s for s in parts)
    assert (r["ragged_us"], r["padded_us"]) == (10.0, 14.0) and r["layers"] == 3
    assert r["vs_parts"] == pytest.approx(10.0 / r["parts_us"]) and r["vs_padded"] == pytest.approx(10 / 14)
    assert r["tbs"] == pytest.approx(6 * 32 * 2 * 16 * 2 * 2 / 10.0 / 1e6)  # the caches' K and V bytes
    line = bench.format_ragged_row(r, bench.parse_ragged("b=6,hq=4,hkv=2,d=16,L=32,sq=5")[0])
    assert line.startswith(f"fp16 4/2 d16 b=6 L=32 sq=1-5 [{r['qlens']}] | ragged 10.0us | uniform parts ")
    assert line.endswith(f"| ragged / padded {10 / 14:.3f}x | check ok")


def test_a_uniform_batch_is_one_plain_part(monkeypatch):
    r, calls = ragged_case(monkeypatch, "b=3,hq=4,hkv=2,d=16,L=32,sq=4-4")
    assert r["qlens"] == "4,4,4" and list(r["parts"]) == [4] and r["check"] == "ok"
    assert calls[4] == dict(shape=(3, 4, 4, 16), cu=None, max_seqlen_q=None, idx=None)  # the 4-D call itself


def test_a_misaligned_or_missing_ragged_call_is_reported_and_the_rest_timed(monkeypatch):
    r, _ = ragged_case(monkeypatch, "b=4,hq=4,hkv=2,d=16,L=32,sq=6", aligned=False)
    assert r["check"].startswith("ragged max error") and r["ragged_us"] is None and r["padded_us"] == 14.0
    assert "vs_parts" not in r and "tbs" not in r
    r, _ = ragged_case(monkeypatch, "b=4,hq=4,hkv=2,d=16,L=32,sq=6", ragged=False)
    assert r["check"].startswith("ragged n/a (TypeError: flash_decode() got an unexpected keyword")
    assert r["parts_us"] and r["ragged_us"] is None


def ragged_row(lo=1, hi=8, ragged=10.0, parts=12.0, padded=14.0):
    return dict(dtype="fp16", b=8, hq=32, hkv=8, d=128, L=4096, lo=lo, hi=hi, total_q=37, kv_mb=134.2, layers=3,
                qlens="1,8", check="ok", ragged_us=ragged, padded_us=padded, parts={1: 4.0, 8: 8.0}, parts_us=parts,
                tbs=13.4, vs_parts=ragged / parts, vs_padded=ragged / padded)


def test_ragged_markdown_and_summary():
    rows = [ragged_row(), ragged_row(ragged=11.0), ragged_row(lo=4, hi=4, ragged=10.1, parts=10.0, padded=10.0),
            dict(ragged_row(), ragged_us=None, vs_parts=None, vs_padded=None, tbs=None,
                 check="ragged n/a (TypeError)")]
    lines = bench.markdown(bench.ragged_columns(), rows).split("\n")
    assert lines[0] == ("| dtype | heads q/kv | d | batch | cache len | query lengths | query rows | cache MB | ragged µs "
                        "| TB/s | uniform parts µs (sum) | ragged / parts | padded µs | ragged / padded | check |")
    assert lines[2] == ("| fp16 | 32/8 | 128 | 8 | 4096 | 1-8 | 37 | 134.2 | **10.0** | 13.40 | 12.0 | 0.833 | 14.0 "
                        "| 0.714 | ok |")
    assert "| 4 | 37 |" in lines[4] and lines[5].endswith("| – | – | 12.0 | – | 14.0 | – | ragged n/a (TypeError) |")
    s = dict(bench.ragged_summary(rows))
    mixed = math.sqrt(10 / 12 * 11 / 12)
    assert s["ragged call over the sum of its uniform parts, mixed lengths (time / time)"] == \
        f"geomean {mixed:.3f}x, min 0.833x, max 0.917x over 2 shapes"
    assert s["ragged call over the call padded to the longest, equal lengths (time / time)"] == \
        "geomean 1.010x, min 1.010x, max 1.010x over 1 shape"


def test_main_runs_ragged_alone_and_writes_its_markdown(tmp_path, monkeypatch, capsys):
    gpu_stand_ins(monkeypatch)
    seen = []

    def fake_case(ragged, dtype, repeats, seed):
        seen.append((ragged, dtype, seed))
        if ragged.shape.b == 2:
            raise RuntimeError("out of memory")
        return ragged_row(lo=ragged.lo, hi=ragged.shape.sq)

    monkeypatch.setattr(bench, "run_ragged_case", fake_case)
    out = tmp_path / "bench"
    assert bench.main(["--ragged", "b=8,sq=8;b=2,sq=3", "--seed", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert [(r.shape.b, dt, seed) for r, dt, seed in seen] == [(8, "fp16", 4), (2, "fp16", 4)]
    assert "[ragged 2/2] fp16 32/8 d128 b=2 L=32768 sq=1-3 | check n/a (RuntimeError: out of memory)" in printed
    text = (out / "ragged.md").read_text()
    assert text in printed + "\n" and not (out / "table.md").exists() and not (out / "serving.md").exists()
    assert "- ragged call over the sum of its uniform parts, mixed lengths (time / time): geomean 0.833x" in text
    data = json.loads((out / "results.json").read_text())
    assert len(data["meta"]["ragged"]) == 2 and data["rows"] == []
