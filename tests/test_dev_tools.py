"""The developer tools in dev/ still run where CI runs (no GPU): the sanitizer
driver plans every kernel path it is named for, the thread benchmark parses
its arguments, the host-cost timer runs every case on the fake device (and
on a GPU, where there is one), the A/B driver alternates its builds and
summarizes their runs, the SASS reader finds a kernel's tile loop and its
counts in cuobjdump's and ptxas's output, the trace's dump reader splits
each call's blocks at its median end, the streaming probe compiles
for sm_90a with its wgmma loops unserialized, and the launch probe's kernel
assembles and its launches run on the fake device."""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from conftest import FAKEDEVICE, has_extension

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")
def test_sanitize_dry_run_reaches_every_path():
    # --dry-run builds each call's arguments on the meta device and checks that
    # its plan (H200, device=-1) still takes the path the case is named for.
    child = run("dev/sanitize.py", "--dry-run")
    assert child.returncode == 0, child.stderr[-2000:]
    lines = child.stdout.splitlines()
    assert lines[-1] == "done"
    plans = [line for line in lines if ": fd_split_kv_" in line]
    assert len(plans) >= 20
    assert any("combine fd_combine_f16_c32" in line for line in plans)
    assert any("cluster 1," not in line and "combine -" in line for line in plans)
    assert any("whole_items 0," not in line for line in plans)
    assert any("prefetch_tiles 0," not in line for line in plans)


@pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")
def test_sanitize_only_runs_the_paths_it_names():
    child = run("dev/sanitize.py", "--dry-run", "--only", "^paged|merge_state$")
    assert child.returncode == 0, child.stderr[-2000:]
    names = [line.split(":")[0] for line in child.stdout.splitlines()]
    assert names[-1] == "done" and "merge_state" in names
    paths = [name for name in names if name not in ("done", "merge_state")]
    assert paths and all(name.startswith("paged") for name in paths), names


def test_threads_tool_parses_its_arguments():
    child = run("dev/threads.py", "--help")
    assert child.returncode == 0, child.stderr[-2000:]
    assert "--calls" in child.stdout


@pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")
@pytest.mark.skipif(not (FAKEDEVICE / "libcuda.so.1").exists(), reason=f"no fake-device driver at {FAKEDEVICE}")
def test_host_cost_times_every_case_on_the_fake_device():
    env = dict(os.environ, LD_LIBRARY_PATH=str(FAKEDEVICE))
    env.pop("FLASH_DECODE_FORCE_NATIVE", None)
    child = subprocess.run([sys.executable, "dev/host_cost.py", "--calls", "20", "--rounds", "1"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, env=env)
    assert child.returncode == 0, child.stderr[-2000:]
    names = [line.split("  ")[0] for line in child.stdout.splitlines()]
    assert names == ["plain", "plain, (b, h, s, d) views", "int cache_seqlens", "int cache_seqlens, growing",
                     "lengths + max_seqlen_k", "lengths + growing bound", "lse, 32K workspace", "paged append",
                     "plain, out given", "torch.empty_like(q)", "binding Run alone",
                     "binding Run, one split"], child.stdout


@pytest.mark.cuda
def test_host_cost_times_the_parts_on_the_gpu():
    child = subprocess.run([sys.executable, "dev/host_cost.py", "--gpu", "--calls", "20", "--rounds", "1"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    times = {line.split("  ")[0]: float(line.split()[-4]) for line in child.stdout.splitlines()}
    assert list(times)[-4:] == ["binding Run alone", "binding Run, one split", "current stream", "torch SDPA"]
    assert all(us > 0 for us in times.values()), child.stdout


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f"dev_{name}", ROOT / "dev" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_sass_tool():
    return load_tool("sass")


def bench_result(us, serving_us=None, splits=2):
    """A bench results.json with one table row (b=1, 32/8, d128, 32K keys) and, if
    serving_us, one serving row."""
    row = dict(dtype="fp16", b=1, hq=32, hkv=8, d=128, L=32768, sq=1, ours_us=us, num_splits=splits,
               kernel="fd_split_kv_f16_d128_r16")
    serving = [dict(case="ragged", dtype="fp16", b=8, hq=32, hkv=8, d=128, L=32768, sq=1, us=serving_us)]
    lengths = [dict(lengths="32768,1024", b=2, hq=32, hkv=8, d=128, num_splits=8, us=us, unbalanced_us=3 * us,
                    even_us=us - 1, even_unbalanced_us=us - 2)]
    return dict(meta=dict(serving=serving if serving_us else [], lengths=lengths), rows=[row], summary=[])


def test_trace_dump_reader_splits_each_call_at_its_median_end(tmp_path):
    # dev/trace's TRACE_DUMP rows: scenario, call, kind, block, 8 stamps (ns from the call's
    # first release), SM. Blocks 0-1 stream 10 us, 2-3 20 us; block 4 found no split (no first
    # tile); the combine's row is not stage 1's.
    rows = []
    for call in range(3):
        for block, (loop, sm) in enumerate([(10_000, 0), (10_000, 1), (20_000, 3), (20_000, 2), (0, 4)]):
            tile0 = 2_000 if loop else 0
            stamps = [-1_000, 0, 500, 800, tile0, tile0 + loop, tile0 + loop + 1_000, tile0 + loop + 1_200]
            rows.append("\t".join(map(str, ["s", call, "s1", block, *stamps, sm])))
        rows.append("\t".join(map(str, ["s", call, "comb", 0, *[0] * 8, 4])))
    dump = tmp_path / "d.tsv"
    dump.write_text("\n".join(rows) + "\n")
    tool = load_tool("trace/dump")
    calls = tool.read(str(dump))["s"]
    assert sorted(calls) == [0, 1, 2] and len(calls[2]) == 5
    halves = tool.halves(calls)
    assert halves["loop"] == (20.0, 10.0) and halves["first tile"] == (2.0, 2.0)
    assert halves["end"] == (pytest.approx(23.2), pytest.approx(13.2))
    assert tool.maps(calls[2], 3_000) == ("ffSS", "ffSS.")
    child = run("dev/trace/dump.py", str(dump), "--maps", "1")
    assert child.returncode == 0, child.stderr[-2000:]
    assert "by block ffSS" in child.stdout and "by SM    ffSS." in child.stdout


def test_ab_tool_alternates_and_summarizes_each_build_against_the_first(tmp_path):
    ab = load_tool("ab")
    assert ab.order(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    # Runs as dev/ab.py leaves them: <pass>_<build>/results.json; a failed run has none.
    times = {"a": [10.0, 10.4, 10.2], "b": [9.0, 9.3, 9.1]}
    for name, us in times.items():
        for i, t in enumerate(us):
            d = tmp_path / f"{i}_{name}"
            d.mkdir()
            result = bench_result(t, serving_us=2 * t, splits=2 if name == "a" else 4)
            (d / "results.json").write_text(json.dumps(result))
    (tmp_path / "3_b").mkdir()
    runs = ab.load_runs(tmp_path)
    assert list(runs) == ["a", "b"] and [len(r) for r in runs.values()] == [3, 3]
    table, serving, *lengths = ab.summarize(runs)
    assert [s["case"] for s in lengths] == [f"lengths b=2 32/8 d128 [32768,1024] {t}" for t in
                                            ("planned", "unbalanced", "even", "even unbalanced")]
    assert lengths[1]["builds"]["a"]["median"] == pytest.approx(30.6) and not lengths[1]["plan_differs"]
    assert table["case"] == "fp16 b=1 32/8 d128 L=32768 sq1"
    assert table["builds"]["a"] == {"median": 10.2, "min": 10.0, "max": 10.4, "passes": 3}
    assert table["change"]["b"] == pytest.approx(9.1 / 10.2 - 1)
    assert table["plan_differs"]  # 2 splits against 4
    assert serving["case"].startswith("serving ragged fp16 b=8")
    assert serving["builds"]["b"]["median"] == pytest.approx(18.2) and not serving["plan_differs"]
    ab.write_summary(tmp_path, ["b", "a"])  # b the baseline
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[0]["change"] == {"a": pytest.approx(10.2 / 9.1 - 1)}
    assert "+12.1%" in (tmp_path / "summary.txt").read_text()


def test_ab_tool_runs_each_build_from_its_own_folder(tmp_path):
    # Two "builds": folders holding a stand-in flash_decode whose bench writes a
    # results.json with its own time, so the runs need no GPU.
    bench = """import json, pathlib, sys
args = sys.argv[1:]
out = pathlib.Path(args[args.index("--out") + 1])
out.mkdir(parents=True)
assert "--no-plot" in args and args[:2] == ["--shapes", "b=1,L=32k"]
row = dict(dtype="fp16", b=1, hq=32, hkv=8, d=128, L=32768, sq=1, ours_us=US, num_splits=16, kernel="k")
(out / "results.json").write_text(json.dumps(dict(meta=dict(serving=[]), rows=[row], summary=[])))
"""
    for name, us in (("old", 12.0), ("new", 9.0)):
        pkg = tmp_path / name / "flash_decode"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "bench.py").write_text(bench.replace("US", str(us)))
    out = tmp_path / "runs"
    (out / "2_old").mkdir(parents=True)  # an earlier comparison's third pass: removed, not summarized
    (out / "2_old" / "results.json").write_text(json.dumps(bench_result(100.0)))
    child = run("dev/ab.py", "--build", f"old={tmp_path / 'old'}", "--build", f"new={tmp_path / 'new'}",
                "--passes", "2", "--out", str(out), "--", "--shapes", "b=1,L=32k")
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-2000:]
    assert sorted(d.name for d in out.iterdir() if d.is_dir()) == ["0_new", "0_old", "1_new", "1_old"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary[0]["builds"]["new"]["median"] == 9.0 and summary[0]["change"]["new"] == -0.25
    assert "-25.0%" in child.stdout
    # Summarized again later, the baseline is still the build given first, not the first by name.
    (out / "summary.json").unlink()
    child = run("dev/ab.py", "--summarize", str(out))
    assert child.returncode == 0, child.stderr[-2000:]
    assert json.loads((out / "summary.json").read_text())[0]["change"] == {"new": -0.25}


def test_ab_tool_builds_a_git_revision_into_a_wheel(tmp_path, monkeypatch):
    # git:REV exports the revision's tree and runs pip wheel on it; pip is a stand-in here.
    ab = load_tool("ab")
    real_run, seen = subprocess.run, []

    def fake_run(cmd, **kw):
        if cmd[:4] != [sys.executable, "-m", "pip", "wheel"]:
            return real_run(cmd, **kw)
        seen.append(cmd)
        src, dist = pathlib.Path(cmd[-3]), pathlib.Path(cmd[-1])
        assert (src / "pyproject.toml").is_file() and (src / "kernels" / "combine.cuh").is_file()
        (dist / "flash_decode-0-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    if real_run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    wheel = ab.build_wheel("head", "HEAD", tmp_path)
    assert wheel == (tmp_path / "wheel_head" / "flash_decode-0-py3-none-any.whl").resolve() and len(seen) == 1
    assert "--no-build-isolation" in seen[0] and "--no-deps" in seen[0]
    with pytest.raises(SystemExit, match="git archive no-such-rev"):
        ab.build_wheel("bad", "no-such-rev", tmp_path)


def test_ab_tool_parses_its_arguments():
    ab = load_tool("ab")
    args = ab.parse_args(["--build", "x=w1.whl", "--build", "y=site", "--", "--shapes", "b=1,L=1k", "--peers", "none"])
    assert args.build == [("x", pathlib.Path("w1.whl")), ("y", pathlib.Path("site"))]
    assert args.bench_args == ["--shapes", "b=1,L=1k", "--peers", "none"]
    for bad in (["--build", "x=a"], ["--build", "x=a", "--build", "x=b"],
                ["--build", "x=a", "--build", "y=b", "--", "--out", "o"]):
        with pytest.raises(SystemExit):
            ab.parse_args(bad)
    child = run("dev/ab.py", "--help")
    assert child.returncode == 0 and "--summarize" in child.stdout, child.stderr[-2000:]


# cuobjdump -sass's layout: a function header, then /*address*/ instruction ; /* encoding */.
_SASS = """
\t\tFunction : fd_split_kv_f16_d128_r16
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;          /* 0x0000000000007b1d */
        /*0020*/               @P0 BRA 0x50 ;                             /* 0x0000000000000947 */
        /*0030*/                   LDGSTS.E.BYPASS.128 [R5], desc[UR8][R2.64] ; /* 0x0000000002057fae */
        /*0040*/                   LDGSTS.E.BYPASS.128 [R5+0x4000], desc[UR8][R6.64], P1 ; /* 0x0 */
        /*0050*/                   HMMA.16816.F32 R8, R12, R16, RZ ;       /* 0x0000001010087c3c */
        /*0060*/              @!P2 BRA 0x10 ;                             /* 0x0000000000000947 */
        /*0070*/                   HMMA.16816.F32 R8, R12, R16, R8 ;       /* 0x0000001010087c3c */
        /*0080*/              @!P3 BRA 0x70 ;                             /* 0x0000000000000947 */
        /*0090*/                   EXIT ;                                 /* 0x000000000000794d */
\t\tFunction : fd_combine_f16
        /*0000*/                   EXIT ;                                 /* 0x000000000000794d */
"""

_PTXAS = """ptxas info    : Compiling entry function 'fd_split_kv_f16_d128_r16' for 'sm_90'
ptxas info    : Function properties for fd_split_kv_f16_d128_r16
    8 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 178 registers, used 3 barriers, 4224 bytes smem
ptxas info    : Compiling entry function 'fd_combine_f16' for 'sm_90'
ptxas info    : Function properties for fd_combine_f16
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 56 registers, used 0 barriers
"""


def test_sass_tool_finds_the_tile_loop():
    sass = load_sass_tool()
    kernels = sass.parse_sass(_SASS)
    assert sorted(kernels) == ["fd_combine_f16", "fd_split_kv_f16_d128_r16"]
    body = kernels["fd_split_kv_f16_d128_r16"]
    assert len(body) == 10 and body[2] == (0x20, "@P0 BRA 0x50")
    # Two backward branches hold one HMMA each: the shorter loop (0x70-0x80) wins the tie.
    assert [addr for addr, _ in sass.tile_loop(body)] == [0x70, 0x80]
    # A loop with more HMMAs wins over a shorter one; its copies and branches are counted.
    body.insert(6, (0x58, "HMMA.16816.F32 R20, R12, R16, RZ"))
    loop = sass.tile_loop(body)
    assert loop[0][0] == 0x10 and loop[-1][0] == 0x60
    assert (sass.count(loop, "HMMA"), sass.count(loop, "LDGSTS"), sass.count(loop, "BRA")) == (2, 2, 2)
    # A pass skips the copies (@P0 BRA 0x50 taken: 5 instructions) or makes them (7).
    assert sass.loop_paths(body, loop) == ([5, 7], False)
    assert sass.tile_loop(kernels["fd_combine_f16"]) == []
    assert sass.parse_resources(_PTXAS) == {"fd_split_kv_f16_d128_r16": (178, 12, 4), "fd_combine_f16": (56, 0, 0)}
    resources = sass.parse_resources(_PTXAS)
    assert sass.summary("fd_split_kv_f16_d128_r16", resources, {"fd_split_kv_f16_d128_r16": loop}) == (
        "178 regs, spills 12/4 B, loop 7 instructions (5/7 a pass): 2 HMMA, 2 LDGSTS, 2 BRA")
    # A pass that leaves the loop for code placed after it and jumps back in counts that code too.
    out_of_line = [(0x0, "MOV R1, c[0x0][0x28]"), (0x10, "BAR.SYNC.DEFER_BLOCKING 0x0"), (0x20, "@P0 BRA 0x70"),
                   (0x30, "HMMA.16816.F32 R8, R12, R16, RZ"), (0x40, "HMMA.16816.F32 R8, R12, R16, R8"),
                   (0x50, "@!P1 BRA 0x10"), (0x60, "EXIT"), (0x70, "LDGSTS.E.BYPASS.128 [R5], desc[UR8][R2.64]"),
                   (0x80, "LDGSTS.E.BYPASS.128 [R5+0x4000], desc[UR8][R6.64]"), (0x90, "BRA 0x30")]
    loop = sass.tile_loop(out_of_line)
    assert [addr for addr, _ in loop] == [0x10, 0x20, 0x30, 0x40, 0x50]
    assert sass.loop_paths(out_of_line, loop) == ([5, 8], False)
    # An inner loop (an unconditional backward branch) stops the pass count, not the summary.
    inner = [(0x0, "BAR.SYNC.DEFER_BLOCKING 0x0"), (0x10, "HMMA.16816.F32 R8, R12, R16, RZ"), (0x20, "BRA 0x10"),
             (0x30, "HMMA.16816.F32 R8, R12, R16, R8"), (0x40, "@P0 BRA 0x0")]
    assert sass.summary("fd_split_kv_f16_d128_r16", resources, {"fd_split_kv_f16_d128_r16": inner}) == (
        "178 regs, spills 12/4 B, loop 5 instructions (uncounted a pass): 2 HMMA, 0 LDGSTS, 2 BRA")


def test_sass_tool_counts_the_loads_in_flight_at_their_first_use():
    sass = load_sass_tool()
    # A combine's fold step: its LSE (32-bit) and row (128-bit) loads after the PDL wait, then the
    # math on them. A load before the wait, and a use of a register no wide load wrote, do not count.
    hoisted = [(0x0, "LDG.E.128 R40, desc[UR6][R2.64]"), (0x10, "ACQBULK"), (0x20, "@!P0 LDG.E R16, desc[UR6][R16.64]"),
               (0x30, "FMUL R17, R16, 1.4426950216293334961"), (0x40, "@!P1 LDG.E.128 R20, desc[UR6][R76.64]"),
               (0x50, "@!P1 LDG.E.128 R24, desc[UR6][R76.64+0x200]"), (0x60, "LDG.E.64 R30, desc[UR6][R8.64]"),
               (0x70, "MUFU.EX2 R28, R17"), (0x80, "FFMA R36, R28, R23, R36"), (0x90, "EXIT")]
    assert sass.loads_in_flight(hoisted) == (3, 3)
    # ptxas sinking the second row below the first one's use: one load in flight when the math starts.
    sunk = hoisted[:5] + [(0x48, "FMUL R40, R28, R21")] + hoisted[5:]
    assert sass.loads_in_flight(sunk) == (1, 3)
    # A store reads its first operand too.
    assert sass.loads_in_flight([(0x0, "LDG.E.64 R4, desc[UR6][R2.64]"), (0x10, "STG.E desc[UR6][R8.64], R5"),
                                 (0x20, "LDG.E.128 R12, desc[UR6][R2.64+0x10]")]) == (1, 2)
    assert sass.loads_in_flight([(0x0, "EXIT")]) == (0, 0)
    assert sass.summary("k", {"k": (154, 0, 0)}, {"k": hoisted}) == (
        "154 regs, 10 instructions, no mma loop, 3 of 3 wide loads issued before the first use")


def test_sass_tool_finds_the_first_copy_after_the_pdl_wait():
    sass = load_sass_tool()
    body = [(0x0, "MOV R1, c[0x0][0x28]"), (0x10, "CCTL.E.PF2 [R24]"), (0x20, "ACQBULK"), (0x30, "@P0 PREEXIT"),
            (0x40, "LDG.E R16, desc[UR10][R16.64]"), (0x50, "@P1 LDGSTS.E [R3], desc[UR10][R4.64]"),
            (0x60, "IMAD R5, R2, 0x40, RZ"), (0x70, "@P2 LDGSTS.E.BYPASS.128 [R15], desc[UR10][R28.64]"),
            (0x80, "LDGSTS.E.BYPASS.128 [R15+0x4000], desc[UR10][R30.64]"), (0x90, "EXIT")]
    # A 4-byte copy (a page id) is not a tile copy; a predicated 16-byte one is.
    assert sass.first_copy(body) == 5
    assert sass.first_copy([ins for ins in body if ins[1] != "ACQBULK"]) is None
    assert sass.first_copy(body[:7]) is None
    assert sass.summary("k", {"k": (175, 0, 0)}, {"k": body}) == (
        "175 regs, 10 instructions, no mma loop, first tile copy 5 after the PDL wait")


def test_sass_tool_parses_its_arguments():
    child = run("dev/sass.py", "--help")
    assert child.returncode == 0, child.stderr[-2000:]
    assert "--against" in child.stdout


def find_nvcc():
    home = os.environ.get("CUDA_HOME")
    if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


@pytest.mark.skipif(find_nvcc() is None, reason="no nvcc (set CUDA_HOME or put nvcc on PATH)")
def test_stream_probe_compiles_with_its_wgmma_loops_unserialized(tmp_path):
    # ptxas says C7515 where it serializes wgmma (an accumulator written by
    # another instruction while a wgmma may own it) and C7519 where it has to
    # wait for the warpgroup before a wgmma; the probe's loops must need neither.
    child = subprocess.run([find_nvcc(), "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a",
                            "-Xptxas", "-v", "-c", "-o", str(tmp_path / "stream.o"), "dev/stream/stream.cu"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = child.stdout + child.stderr
    assert child.returncode == 0, log[-3000:]
    assert "stream_wgx" in log and "stream_prod" in log  # the kernels were compiled
    assert "C7515" not in log and "C7519" not in log, [line for line in log.splitlines() if "C75" in line][:5]


@pytest.mark.skipif(find_nvcc() is None or shutil.which("gcc") is None, reason="no nvcc (CUDA_HOME) or no gcc")
@pytest.mark.skipif(not (FAKEDEVICE / "libcuda.so.1").exists(), reason=f"no fake-device driver at {FAKEDEVICE}")
def test_launch_probe_assembles_and_launches_on_the_fake_device(tmp_path):
    home = pathlib.Path(find_nvcc()).parent.parent
    exe = tmp_path / "launch"
    child = subprocess.run(["gcc", "-O2", "-std=c11", "-Wall", "-Werror", f"-I{home / 'include'}", "-Ikernels",
                            "-o", str(exe), "dev/launch/launch.c", f"-L{FAKEDEVICE}", "-lcuda"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    env = dict(os.environ, LD_LIBRARY_PATH=str(FAKEDEVICE))
    ptx = subprocess.run([str(exe), "ptx"], capture_output=True, text=True, timeout=60, env=env)
    assert ptx.returncode == 0 and ".entry fd_launch_probe" in ptx.stdout, ptx.stderr
    (tmp_path / "probe.ptx").write_text(ptx.stdout)
    child = subprocess.run([str(home / "bin" / "ptxas"), "-arch=sm_90", "-o", str(tmp_path / "probe.cubin"),
                            str(tmp_path / "probe.ptx")], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    # The fake device launches through cuLaunchKernelEx only, and has no streams of its own or
    # graphs: those cells say n/a, the Ex forms' on the legacy stream hold times.
    child = subprocess.run([str(exe), "20", "3"], capture_output=True, text=True, timeout=60, env=env)
    assert child.returncode == 0, child.stderr[-2000:]
    rows = [line.split(" | ") for line in child.stdout.splitlines() if line.startswith("| Ex")]
    assert len(rows) == 7, child.stdout
    assert all(re.fullmatch(r"\d+\.\d\d / \d+\.\d\d", row[1]) for row in rows), child.stdout
