"""Import, public API, native loading and what the torch layer sends to the
binding, on any machine (no GPU needed).

The Go extension links gorgonia.org/cu, which calls os.Exit(1) if cuInit fails,
so these tests run the risky parts in a child interpreter and check that it
survives. Where $FAKECUDA_DIR/libcuda.so.1 (a stand-in driver whose cuInit
succeeds and which reports no device) and the installed extension exist, the
real binding is loaded against it: planner, layouts, error mapping and the gc
fix. The calls the torch layer makes are checked against conftest.FakeBinding.
"""

import inspect
import json

import pytest
import torch

import flash_decode
from conftest import FAKECUDA, FAKEDEVICE, has_extension, run_python
from flash_decode import _api

NO_DRIVER = "flash_decode needs an NVIDIA GPU with a CUDA driver"
needs_fakecuda = pytest.mark.skipif(not (FAKECUDA / "libcuda.so.1").exists(),
                                    reason=f"no stand-in driver at {FAKECUDA}/libcuda.so.1")
needs_extension = pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")
needs_fake_device = pytest.mark.skipif(not (FAKEDEVICE / "libcuda.so.1").exists(),
                                       reason=f"no fake-device driver at {FAKEDEVICE}")


def test_public_api():
    assert flash_decode.__all__ == ["flash_decode", "plan", "merge_states", "merge_state", "__version__"]
    assert isinstance(flash_decode.__version__, str)
    params = inspect.signature(flash_decode.flash_decode).parameters
    # flash_attn_with_kvcache's signature: the same names in the same order.
    assert list(params)[:5] == ["q", "k_cache", "v_cache", "k", "v"]
    assert params["k"].default is None and params["v"].default is None
    keywords = [(n, p.default) for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    assert keywords == [("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
                        ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
                        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
                        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
                        ("num_splits", 0), ("return_softmax_lse", False), ("out", None),
                        ("max_seqlen_k", None)]
    params = inspect.signature(flash_decode.plan).parameters
    assert list(params)[:6] == ["batch", "seqlen_q", "nheads_q", "nheads_kv", "headdim", "seqlen_cache"]
    assert {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} == {
        "dtype", "num_splits", "device", "seqlen", "serving", "seqlen_new", "window_size", "rotary", "page_size",
        "lengths"}
    for fn in (flash_decode.flash_decode, flash_decode.plan):
        assert "Example" in fn.__doc__ and ">>>" in fn.__doc__


def test_import_touches_no_native_code():
    child = run_python(
        "import sys, torch, flash_decode\n"
        "from flash_decode import _native\n"
        "top = _native.BINDING_MODULE.rsplit('.', 1)[0]\n"
        "assert not [m for m in sys.modules if m.startswith(top)], sys.modules.keys()\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('OK')\n")
    assert child.returncode == 0 and "OK" in child.stdout, child.stderr


def test_no_gpu_raises_runtime_error():
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on GPU machines too.
    child = run_python(
        "import sys, flash_decode\n"
        "from flash_decode import _native\n"
        "for attempt in range(2):\n"
        "    try:\n"
        "        flash_decode.plan(1, 1, 32, 8, 128, 1024, device=0)\n"
        "    except RuntimeError as err:\n"
        "        print('RuntimeError:', err)\n"
        "assert _native.BINDING_MODULE not in sys.modules\n"
        "print('ALIVE')\n",
        CUDA_VISIBLE_DEVICES="")
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert lines[-1] == "ALIVE"
    assert len(lines) == 3 and lines[0] == lines[1] and lines[0].startswith("RuntimeError: " + NO_DRIVER)


def test_plan_checks_arguments_first():
    with pytest.raises(TypeError, match="^dtype"):
        flash_decode.plan(1, 1, 32, 8, 128, 1024, dtype=torch.float32)
    with pytest.raises(TypeError, match="^headdim"):
        flash_decode.plan(1, 1, 32, 8, 128.0, 1024)
    with pytest.raises(TypeError, match="^num_splits"):
        flash_decode.plan(1, 1, 32, 8, 128, 1024, num_splits=2.0)
    # The Go core reads a negative length as "the whole cache": Python refuses one.
    with pytest.raises(ValueError, match="^seqlen=-2 must not be negative"):
        flash_decode.plan(1, 1, 32, 8, 128, 1024, seqlen=-2)
    # -1 is the default device; other negative indices and bools are mistakes.
    with pytest.raises(ValueError, match="^device=-2 must be a CUDA device index"):
        flash_decode.plan(1, 1, 32, 8, 128, 1024, device=-2)
    with pytest.raises(TypeError, match="^device must be an int, a str or a torch.device, got bool"):
        flash_decode.plan(1, 1, 32, 8, 128, 1024, device=True)


def launch_on_fake_device(script, tmp_path):
    """Runs script in a child on the fake-device driver; returns the JSON of
    its last line of output and the logged launches, one list of fields per
    launch: kernel gx gy gz threads shared cluster pdl."""
    log = tmp_path / "launches.log"
    child = run_python(script, LD_LIBRARY_PATH=str(FAKEDEVICE), FLASH_DECODE_FORCE_NATIVE=None,
                       FAKECUDA_LAUNCH_LOG=str(log))
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.splitlines()[-1]), [line.split() for line in log.read_text().splitlines()]


_LAUNCH_THROUGH_THE_BINDING = """
import json
import flash_decode
from flash_decode import _native
b, G = _native.binding(), 1 << 30
q, o, k = (4096, 4096, 128, 1), (4096, 4096, 128, 1), (32768 * 1024, 1024, 128, 1)
h = b.Prepare(1, 1, 1, 32, 8, 128, 32768, *q, *k, *k, *o, 0.0, True, False, 32, 0, False)
ws = b.Workspace(h, -1)
splits = b.Run(h, -1, 1 * G, 64 * G, 128 * G, 2 * G, 3 * G, 4 * G, 10 * G, ws, 0)
print(json.dumps(dict(flash_decode.plan(1, 1, 32, 8, 128, 32768, num_splits=32, device=0), ran=splits, ws=ws)))
"""


@needs_extension
@needs_fake_device
def test_binding_launches_the_plan_on_a_fake_device(tmp_path):
    # Python -> the gopy extension (Run keeps the GIL) -> the Go core -> the driver, on a
    # stand-in whose one device launches nothing and logs each launch: the split kernel and
    # the combine, with the plan's grids and programmatic dependent launch.
    plan, launches = launch_on_fake_device(_LAUNCH_THROUGH_THE_BINDING, tmp_path)
    assert plan["ran"] == plan["num_splits"] == 32 and plan["ws"] == plan["workspace_bytes"] > 0
    grid = " ".join(map(str, plan["grid"]))
    assert [" ".join(launch) for launch in launches] == [
        f"{plan['kernel']} {grid} {plan['threads']} {plan['shared_bytes']} 1 1",
        f"{plan['combine']} {plan['combine_grid']} 1 1 {plan['combine_threads']} 0 1 1"]


_SERVING_LAUNCH_THROUGH_THE_BINDING = """
import json, torch
from flash_decode import _api, _native
# The layout the torch layer sends for a paged append with rotary (CPU tensors: only their
# shapes and strides are read), then a call with made-up device addresses.
q = torch.empty(2, 1, 32, 128, dtype=torch.float16)
pages = torch.empty(512, 16, 8, 128, dtype=torch.float16)
new = torch.empty(2, 1, 8, 128, dtype=torch.float16)
cos = torch.empty(8192, 64, dtype=torch.float16)
lens, table = torch.empty(2, dtype=torch.int32), torch.empty(2, 256, dtype=torch.int32)
layout = _api._serving_layout(q, pages, pages, new, new, cos, cos, lens, None, None, table, None, True,
                              (-1, -1), 0.0, False, None, 0, None)
b, G = _native.binding(), 1 << 30
h = b.PrepareServing(json.dumps(layout), 0)
ws = b.WorkspaceServing(h, -1)
splits = b.RunServing(h, -1, 1 * G, 64 * G, 128 * G, 2 * G, 0, 4 * G, 5 * G, 0, 0, 0, 6 * G, 7 * G, 8 * G, 9 * G,
                      10 * G, ws, 0)
print(json.dumps(dict(splits=splits, ws=ws)))
"""


@needs_extension
@needs_fake_device
def test_serving_binding_launches_append_then_stage_1(tmp_path):
    # The serving path through the binding (the layout as JSON, then RunServing): the append
    # kernel, then the paged form of the serving stage 1 (pages of 16) with as many splits as
    # RunServing reports, then the combine where it splits; all with programmatic dependent launch.
    ran, launches = launch_on_fake_device(_SERVING_LAUNCH_THROUGH_THE_BINDING, tmp_path)
    names = [launch[0] for launch in launches]
    assert names[:2] == ["fd_append_kv_f16", "fd_split_kv_paged_f16_d128_r16"], names
    assert int(launches[1][1]) == ran["splits"] and launches[1][2:4] == ["8", "2"]  # grid (splits, 8 heads, 2)
    combine = "fd_combine_f16_r4" if ran["splits"] <= 8 else "fd_combine_f16"  # a warp a row up to 8 splits
    assert names[2:] == ([combine] if ran["splits"] > 1 and launches[1][6] == "1" else [])
    assert ran["ws"] > 0  # the rotated q lives in the workspace
    assert all(launch[7] == "1" for launch in launches)


_HINTED_LAUNCH = """
import json
import flash_decode
from flash_decode import _native
b, G = _native.binding(), 1 << 30
q, o, k = (4096, 4096, 128, 1), (4096, 4096, 128, 1), (32768 * 1024, 1024, 128, 1)
h = b.Prepare(1, 1, 1, 32, 8, 128, 32768, *q, *k, *k, *o, 0.0, True, False, 0, 0, False)
for seqlen in (-1, 1024):  # the capacity's plan, then the plan for a bound of 1024 keys
    ws = b.Workspace(h, seqlen)
    b.Run(h, seqlen, 1 * G, 64 * G, 128 * G, 2 * G, 0, 4 * G, 10 * G, ws, 0)
plans = [flash_decode.plan(1, 1, 32, 8, 128, 32768, device=0, seqlen=n) for n in (None, 1024)]
print(json.dumps([[p["kernel"], p["grid"], p["cluster"], p["combine"]] for p in plans]))
"""


@needs_extension
@needs_fake_device
def test_a_length_bound_launches_its_own_plan(tmp_path):
    # With a cache_seqlens tensor, Run's seqlen is the planner's bound (max_seqlen_k's): the
    # launch follows the plan for it, not the capacity's (the kernel reads the lengths).
    (full, bounded), launches = launch_on_fake_device(_HINTED_LAUNCH, tmp_path)
    assert full != bounded  # 32768 keys: the combine; 1024: clusters
    splits = [launch for launch in launches if launch[0].startswith("fd_split_kv_")]
    assert [[s[0], [int(x) for x in s[1:4]], int(s[6])] for s in splits] == [full[:3], bounded[:3]]


_BOUND_WITH_APPEND = """
import json, torch
import flash_decode
from flash_decode import _api
# CPU tensors pass as device 0's (the fake device launches nothing): flash_decode's own path from
# max_seqlen_k to the launch, next to plan() told the same bound.
_api._check_devices = lambda q, **others: 0
_api._current_stream = lambda device: 0
cache = torch.zeros(1, 32768, 8, 128, dtype=torch.float16)
q, new = torch.zeros(1, 1, 32, 128, dtype=torch.float16), torch.zeros(1, 1, 8, 128, dtype=torch.float16)
lens = torch.zeros(1, dtype=torch.int32)
plans = []
for bound in (256, 200, 40000):
    flash_decode.flash_decode(q, cache, cache.clone(), new, new, cache_seqlens=lens, max_seqlen_k=bound)
    p = flash_decode.plan(1, 1, 32, 8, 128, 32768, seqlen=bound, seqlen_new=1, lengths=True, device=0)
    plans.append([p["kernel"], p["grid"], p["cluster"]])
print(json.dumps(plans))
"""


@needs_extension
@needs_fake_device
def test_plan_of_a_bound_with_new_tokens_is_the_plan_launched(tmp_path):
    # plan(seqlen=bound, lengths=True) plans the bound as max_seqlen_k is planned: rounded up to a
    # power of two, capped at the cache, the new tokens counted in it.
    plans, launches = launch_on_fake_device(_BOUND_WITH_APPEND, tmp_path)
    splits = [launch for launch in launches if launch[0].startswith("fd_split_kv_")]
    assert [[s[0], [int(x) for x in s[1:4]], int(s[6])] for s in splits] == plans
    assert plans[0] == plans[1] != plans[2]  # 200 keys are planned as 256; 40000 as the cache's 32768


@needs_extension
@needs_fake_device
def test_a_gpu_older_than_sm80_is_refused_as_unsupported():
    # The fake device posing as sm_70: the kernels' oldest code is sm_80, and the message says so
    # instead of the module loader's driver error.
    child = run_python(
        "import flash_decode\n"
        "try:\n"
        "    flash_decode.plan(1, 1, 32, 8, 128, 1024, device=0)\n"
        "except NotImplementedError as err:\n"
        "    print(err)\n",
        LD_LIBRARY_PATH=str(FAKEDEVICE), FLASH_DECODE_FORCE_NATIVE=None, FAKECUDA_CC_MAJOR="7")
    assert child.returncode == 0, child.stderr[-2000:]
    assert "CUDA device 0 is sm_70; the kernels need sm_80 or newer" in child.stdout, child.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
def test_plan_for_the_current_device_without_a_gpu_names_device_minus_one():
    with pytest.raises(RuntimeError, match="torch sees none; device=-1 plans for a default H200-like device"):
        flash_decode.plan(1, 1, 32, 8, 128, 1024)
    assert flash_decode.plan(1, 1, 32, 8, 128, 1024, device=-1)["num_splits"] >= 1


@needs_fakecuda
def test_fake_driver_without_device():
    child = run_python(
        "import sys, flash_decode\n"
        "from flash_decode import _native\n"
        "try:\n"
        "    flash_decode.plan(1, 1, 32, 8, 128, 1024, device=0)\n"
        "except RuntimeError as err:\n"
        "    print(err)\n"
        "assert _native.BINDING_MODULE not in sys.modules\n",
        LD_LIBRARY_PATH=str(FAKECUDA), FLASH_DECODE_FORCE_NATIVE=None)
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith(NO_DRIVER) and "no CUDA device" in child.stdout


@needs_fakecuda
@needs_extension
def test_plan_with_a_driver_that_sees_no_gpu():
    # cuInit answering CUDA_ERROR_NO_DEVICE (every GPU hidden, or none installed): planning
    # still works (through the wheel's stand-in), decoding still refuses.
    child = run_python(
        "import flash_decode\n"
        "print(flash_decode.plan(1, 1, 32, 8, 128, 32768, device=-1)['num_splits'])\n"
        "try:\n"
        "    flash_decode.plan(1, 1, 32, 8, 128, 1024, device=0)\n"
        "except RuntimeError as err:\n"
        "    print(err)\n",
        LD_LIBRARY_PATH=str(FAKECUDA), FLASH_DECODE_FORCE_NATIVE=None, FAKECUDA_CUINIT="100")
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert lines[0] == "16"
    assert lines[1].startswith(NO_DRIVER) and "CUresult 100" in lines[1]


@needs_fakecuda
def test_fake_driver_cuinit_failure_is_not_fatal():
    child = run_python(
        "import flash_decode\n"
        "try:\n"
        "    flash_decode.plan(1, 1, 32, 8, 128, 1024, device=-1)\n"
        "except RuntimeError as err:\n"
        "    print(err)\n",
        LD_LIBRARY_PATH=str(FAKECUDA), FLASH_DECODE_FORCE_NATIVE="1", FAKECUDA_CUINIT="3")
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith(NO_DRIVER) and "cuInit(0) failed with CUresult 3" in child.stdout


_BINDING_PROBE = """
import gc, importlib, json, time
import flash_decode
from flash_decode import _native

report = {}
# Import the extension the raw way first, to see what gopy registers ...
importlib.import_module(_native.BINDING_MODULE)
report["gopy_callbacks"] = sum("_gopy_gc_cb" in getattr(cb, "__name__", "") for cb in gc.callbacks)
# ... then through the loader, which removes them.
native = _native.binding()
report["callbacks_left"] = sum("_gopy_gc_cb" in getattr(cb, "__name__", "") for cb in gc.callbacks)
gc.collect(0)
start = time.perf_counter()
for _ in range(200):
    gc.collect(0)
report["gc_collect0_us"] = (time.perf_counter() - start) / 200 * 1e6
report["version"] = native.Version()
report["plan"] = flash_decode.plan(1, 1, 32, 8, 128, 32768, device=-1)
report["plan_1"] = flash_decode.plan(1, 1, 32, 8, 128, 32768, num_splits=1, device=-1)
report["plan_4"] = flash_decode.plan(2, 4, 40, 8, 128, 1024, num_splits=4, device=-1,
                                     dtype=__import__("torch").bfloat16)
report["plan_40"] = flash_decode.plan(2, 4, 40, 8, 128, 32768, num_splits=40, device=-1)
report["plan_serving"] = flash_decode.plan(1, 1, 32, 8, 128, 1024, serving=True, device=-1)
report["plan_append"] = flash_decode.plan(1, 1, 32, 8, 128, 1024, seqlen_new=1, device=-1)
report["plan_rotary"] = flash_decode.plan(2, 1, 32, 8, 128, 4096, seqlen_new=1, rotary=True, device=-1)
report["plan_rotary_window"] = flash_decode.plan(2, 1, 32, 8, 128, 4096, seqlen_new=1, rotary=True,
                                                 window_size=(255, 0), device=-1)
report["plan_window"] = flash_decode.plan(1, 1, 32, 8, 128, 32768, window_size=(255, 0), device=-1)
report["plan_257"] = flash_decode.plan(1, 1, 32, 8, 128, 257, serving=True, device=-1)
report["plan_readme_serving"] = flash_decode.plan(1, 1, 32, 8, 128, 32768, seqlen_new=1, page_size=16, device=-1)
report["plan_paged16"] = flash_decode.plan(1, 1, 32, 8, 128, 1024, seqlen_new=1, page_size=16, device=-1)
report["plan_paged16_rotary"] = flash_decode.plan(1, 1, 32, 8, 128, 1024, seqlen_new=1, page_size=16, rotary=True,
                                                  device=-1)
report["plan_paged1"] = flash_decode.plan(1, 1, 32, 8, 128, 1024, seqlen_new=1, page_size=1, device=-1)
report["plan_paged16_window"] = flash_decode.plan(1, 1, 32, 8, 128, 1024, page_size=16, window_size=(255, 0),
                                                  device=-1)
report["plan_b8"] = flash_decode.plan(8, 1, 32, 8, 128, 32768, device=-1)
report["plan_b8_lengths"] = flash_decode.plan(8, 1, 32, 8, 128, 32768, lengths=True, device=-1)
report["plan_b8_lengths_requested"] = flash_decode.plan(8, 1, 32, 8, 128, 32768, lengths=True, num_splits=2,
                                                        device=-1)
report["plan_b32_lengths"] = flash_decode.plan(32, 1, 32, 8, 128, 8192, lengths=True, device=-1)
for name, args, kw in [("heads", (1, 1, 12, 5, 128, 1024), {}), ("batch", (0, 1, 32, 8, 128, 1024), {}),
                       ("splits", (1, 1, 32, 8, 128, 1024), {"num_splits": -2}),
                       ("headdim", (1, 1, 32, 8, 100, 1024), {}),
                       ("rotary", (1, 1, 32, 8, 128, 1024), {"rotary": True}),
                       ("window", (1, 1, 32, 8, 128, 1024), {"window_size": (-2, 0)}),
                       ("serving", (1, 1, 32, 8, 128, 1024), {"serving": 1}),
                       ("seqlen_new", (1, 1, 32, 8, 128, 1024), {"seqlen_new": 2000}),
                       ("seqlen", (1, 1, 32, 8, 128, 1024), {"seqlen": 1000, "seqlen_new": 30}),
                       ("int64", (1, 1, 32, 8, 128, 1024), {"num_splits": 1 << 63})]:
    try:
        flash_decode.plan(*args, device=-1, **kw)
    except Exception as err:
        report["error_" + name] = [type(err).__name__, str(err)]
# Prepare validates without a GPU; Workspace and Run need one (the stand-in has none).
q, kv = 32 * 128, 8 * 128
layout = [1, 1, 1, 32, 8, 128, 1024, q, q, 128, 1, 1024 * kv, kv, 128, 1, 1024 * kv, kv, 128, 1, q, q, 128, 1]
report["handle"] = native.Prepare(*layout, 0.0, True, False, 0, 0, False)
report["handle_again"] = native.Prepare(*layout, 0.0, True, False, 0, 0, False)
for name, args in [("scale", layout + [1e-50, False, False, 0, 0, False]),
                   ("stride", layout[:14] + [2] + layout[15:] + [0.0, True, False, 0, 0, False])]:
    try:
        native.Prepare(*args)
    except Exception as err:
        err = flash_decode._api._translate(err)
        report["prepare_" + name] = [type(err).__name__, str(err)]
for name, call in [("workspace", lambda: native.Workspace(report["handle"], -1)),
                   ("run", lambda: native.Run(report["handle"], -1, 0, 16, 16, 16, 0, 0, 0, 0, 0)),
                   ("run_handle", lambda: native.Run(1 << 20, -1, 16, 16, 16, 16, 0, 0, 0, 0, 0)),
                   # out = q: refused before any GPU work
                   ("run_overlap", lambda: native.Run(report["handle"], -1, 1 << 20, 1 << 24, 1 << 26, 1 << 20,
                                                      0, 0, 0, 0, 0))]:
    try:
        call()
    except Exception as err:
        err = flash_decode._api._translate(err)
        report[name] = [type(err).__name__, str(err)]
print(json.dumps(report))
"""


@needs_fakecuda
@needs_extension
def test_binding_with_fake_driver():
    child = run_python(_BINDING_PROBE, LD_LIBRARY_PATH=str(FAKECUDA), FLASH_DECODE_FORCE_NATIVE="1")
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])

    assert report["gopy_callbacks"] >= 1  # what the fix is for
    assert report["callbacks_left"] == 0
    assert report["gc_collect0_us"] < 50, report["gc_collect0_us"]
    assert isinstance(report["version"], str) and report["version"]

    for key in ("plan", "plan_1", "plan_4", "plan_40"):
        p = report[key]
        assert p["num_splits"] >= 1 and len(p["grid"]) == 3 and p["grid"][0] == p["num_splits"]
        assert isinstance(p["kernel"], str) and p["kernel"]
        # A workspace only for the combine kernel: not for 1 split, nor for a cluster's merge.
        assert (p["workspace_bytes"] == 0) == (p["num_splits"] == 1 or p["cluster"] > 1)
        assert (p["combine"] == "") == (p["workspace_bytes"] == 0)
    # The README's answer to "what does num_splits=0 pick" for b=1, 32/8 heads, 32K tokens.
    readme = {"num_splits": 16, "grid": [16, 8, 1], "cluster": 1, "workspace_bytes": 264192,
              "kernel": "fd_split_kv_f16_d128_r16", "combine": "fd_combine_f16"}
    assert {k: report["plan"][k] for k in readme} == readme
    assert report["plan_1"]["num_splits"] == 1
    p = report["plan_4"]
    assert p["num_splits"] == 4 and p["cluster"] == 4 and p["workspace_bytes"] == 0
    assert "bf16" in p["kernel"]
    p = report["plan_40"]  # beyond a cluster: the combine kernel and its workspace
    # more than 32 splits: the column-group combine, which loads them all in one round trip,
    # a block for each 32 of a row's 128 columns
    assert p["num_splits"] == 40 and p["cluster"] == 1 and p["combine_grid"] == 2 * 40 * 4 * 4
    assert p["combine"].endswith("_c32") and p["combine_threads"] == 128
    assert p["workspace_bytes"] >= 40 * (2 * 40 * 4) * 128 * 4  # splits * rows * headdim * fp32

    # Serving plans: the serving kernels; a contiguous cache's append without rotary runs its
    # appending form (no append kernel); with rotary, or another serving feature, the append
    # kernel runs first, and with rotary the workspace holds the rotated q. A left window plans
    # for the keys it lets a row see (255 + 1 + 1), whatever the cache.
    assert report["plan_serving"]["kernel"] == "fd_split_kv_serving_f16_d128_r16"
    assert "append" not in report["plan_serving"]
    p = report["plan_append"]
    assert p["kernel"] == "fd_split_kv_append_f16_d128_r16" and p["fused_append"] is True and "append" not in p
    for p in (report["plan_rotary"], report["plan_rotary_window"]):
        assert p["kernel"] == "fd_split_kv_serving_f16_d128_r16" and p["append"] == "fd_append_kv_f16"
        assert p["q_rot_bytes"] == 2 * 32 * 128 * 2 and p["workspace_bytes"] >= p["q_rot_bytes"]
    # Pages of a multiple of 8 keys run the paged form (one page lookup per 8 keys), on the same plan;
    # pages of 1, or a window, the serving kernel.
    # The paged form appends a few tokens without rotary itself (no append kernel), with rotary not.
    p16, p1 = report["plan_paged16"], report["plan_paged1"]
    assert p16["kernel"] == "fd_split_kv_paged_append_f16_d128_r16" and p16["variant"]["paged"] is True
    assert p16["fused_append"] is True and "append" not in p16 and p16["variant"]["form"] == "paged_append"
    assert p1["kernel"] == "fd_split_kv_serving_f16_d128_r16" and "paged" not in p1["variant"]
    assert p1["variant"]["form"] == "serving" and report["plan_append"]["variant"]["form"] == "append"
    assert p1["append"] == "fd_append_kv_f16" and "fused_append" not in p1
    same = ("kernel", "variant", "append", "append_grid", "append_threads", "fused_append")
    assert {k: v for k, v in p16.items() if k not in same} == {k: v for k, v in p1.items() if k not in same}
    p = report["plan_paged16_rotary"]
    assert p["kernel"] == "fd_split_kv_paged_f16_d128_r16" and p["append"] == "fd_append_kv_f16"
    assert report["plan_paged16_window"]["kernel"] == "fd_split_kv_serving_f16_d128_r16"
    assert {k: report["plan_window"][k] for k in ("num_splits", "cluster", "grid")} == \
        {k: report["plan_257"][k] for k in ("num_splits", "cluster", "grid")}
    readme = {"num_splits": 32, "grid": [32, 8, 1], "cluster": 1, "kernel": "fd_split_kv_paged_append_f16_d128_r16",
              "fused_append": True}  # the README's serving answer
    assert {k: report["plan_readme_serving"][k] for k in readme} == readme
    # A cache_seqlens tensor (lengths=True) balances the splits on the GPU: the plan for equal
    # lengths' count n, at most 17 a sequence (132 SMs over 8 K/V heads), a 1-D grid of
    # n + 1 blocks an item, the balanced twin of the combine; not for a requested count.
    plain, p = report["plan_b8"], report["plan_b8_lengths"]
    assert "balance_splits" not in plain and plain["num_splits"] == 2
    assert p["balance_splits"] == 2 and p["num_splits"] == 17 and p["grid"] == [8 * 8 * 3, 1, 1]
    assert p["combine"] == plain["combine"] + "_bal" and p["workspace_bytes"] > plain["workspace_bytes"]
    assert "balance_splits" not in report["plan_b8_lengths_requested"]
    p = report["plan_b32_lengths"]  # one split for equal lengths: balanced through a combine too
    assert p["balance_splits"] == 1 and p["num_splits"] == 17 and p["combine"].endswith("_bal")
    assert report["error_rotary"][0] == "ValueError" and "rotary_cos" in report["error_rotary"][1]
    assert report["error_window"][0] == "ValueError" and report["error_window"][1].startswith("window_size")
    assert report["error_serving"][0] == "TypeError" and report["error_serving"][1].startswith("serving")
    # plan's own argument names, not flash_decode's (cache_seqlens, k), and no int past int64 reaches gopy.
    assert report["error_seqlen_new"] == ["ValueError", "seqlen_new=2000 exceeds seqlen_cache=1024"]
    assert report["error_seqlen"] == ["ValueError", "seqlen=1000 and seqlen_new=30 exceed seqlen_cache=1024"]
    assert report["error_int64"] == ["ValueError", f"num_splits={1 << 63} is out of range (a 64-bit int)"]

    assert report["error_heads"][0] == "ValueError" and "invalid argument" in report["error_heads"][1]
    assert report["error_batch"][0] == "ValueError"
    assert report["error_splits"][0] == "ValueError" and "num_splits: invalid argument" in report["error_splits"][1]
    assert report["error_headdim"][0] == "NotImplementedError" and "headdim: not supported" in report["error_headdim"][1]

    assert report["handle"] >= 0 and report["handle_again"] == report["handle"]
    assert report["prepare_scale"][0] == "ValueError" and "softmax_scale" in report["prepare_scale"][1]
    assert report["prepare_stride"][0] == "ValueError" and "k_cache" in report["prepare_stride"][1]
    assert report["workspace"][0] == "ValueError" and "no CUDA device 0" in report["workspace"][1]
    assert report["run"][0] == "ValueError" and ": q: " in report["run"][1]
    assert report["run_handle"][0] == "ValueError" and ": handle: " in report["run_handle"][1]
    assert report["run_overlap"][0] == "ValueError" and "out: invalid argument: bytes" in report["run_overlap"][1]


# ---- what the torch layer sends to the binding (conftest.FakeBinding, CPU tensors) ----

def tensors(batch=2, seqlen_q=1, nheads_q=8, nheads_kv=2, headdim=64, seqlen_cache=1000):
    q = torch.zeros(batch, seqlen_q, nheads_q, headdim, dtype=torch.float16)
    k = torch.zeros(batch, seqlen_cache, nheads_kv, headdim, dtype=torch.float16)
    return q, k, torch.zeros_like(k)


def test_layout_prepared_once_workspace_from_binding(fake_binding):
    q, k, v = tensors()
    lens = torch.tensor([1000, 3], dtype=torch.int32)
    for _ in range(3):
        out, lse = flash_decode.flash_decode(q, k, v, cache_seqlens=lens, return_softmax_lse=True)
        assert out.shape == q.shape and lse.shape == (2, 8, 1)
    (prepared,) = fake_binding.args("Prepare")
    assert prepared == (1, 2, 1, 8, 2, 64, 1000, 512, 512, 64, 1, 128000, 128, 64, 1, 128000, 128, 64, 1,
                        512, 512, 64, 1, 0.0, True, False, 0, 0, True)  # True: a cache_seqlens tensor
    assert fake_binding.args("Workspace") == [(0, -1)]  # the size comes straight from the core
    runs = fake_binding.args("Run")
    assert len(runs) == 3
    for handle, seqlen, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seqlens, ws, ws_bytes, stream in runs:
        assert (handle, seqlen, q_ptr, k_ptr, v_ptr, seqlens) == (0, -1, q.data_ptr(), k.data_ptr(),
                                                                 v.data_ptr(), lens.data_ptr())
        assert out_ptr and lse_ptr and ws and ws_bytes == 1000


@pytest.mark.parametrize("q_bhsd", [(2, 8, 1, 64), (2, 8, 3, 64)], ids=["contiguous but a size-1 stride", "strided"])
def test_out_is_one_dense_block_with_the_registered_strides(fake_binding, q_bhsd):
    # SDPA's (b, h, s, d) q passed as a view: with one query token it is
    # contiguous but for the stride of its dimension of size 1.
    q = torch.zeros(q_bhsd, dtype=torch.float16).transpose(1, 2)
    _, k, v = tensors(seqlen_q=q.shape[1])
    for _ in range(2):  # the first call registers the layout, the second takes the hot path
        out = flash_decode.flash_decode(q, k, v)
        assert out.shape == q.shape and out.is_contiguous()
        assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    registered = fake_binding.args("Prepare")[0][19:23]  # out's strides
    assert all(s == r for n, s, r in zip(out.shape, out.stride(), registered) if n > 1), (out.stride(), registered)


def test_int_cache_seqlens_passed_per_call(fake_binding):
    q, k, v = tensors()
    lengths = [700, 701, 700, 0, 1000, 701]
    for n in lengths:
        flash_decode.flash_decode(q, k, v, cache_seqlens=n, num_splits=4)
    assert len(fake_binding.args("Prepare")) == 1  # one layout for every length
    assert [seqlen for _, seqlen in fake_binding.args("Workspace")] == [700, 701, 0, 1000]
    runs = fake_binding.args("Run")
    assert [r[1] for r in runs] == lengths
    assert [r[9] for r in runs] == [8 * n for n in lengths]  # each length's own workspace
    assert all(r[7] == 0 for r in runs) and runs[3][8] == 0  # no lengths tensor; no workspace of 0 bytes
    # The value is still checked on every call, however many came before.
    with pytest.raises(ValueError, match=r"^cache_seqlens=-1 must not be negative"):
        flash_decode.flash_decode(q, k, v, cache_seqlens=-1, num_splits=4)
    with pytest.raises(TypeError, match=r"^cache_seqlens"):
        flash_decode.flash_decode(q, k, v, cache_seqlens=True, num_splits=4)


def test_int_lengths_share_a_workspace_size_per_block(fake_binding, monkeypatch):
    # The core plans lengths whose keys round up to one multiple of PlanKeyQuantum
    # alike (core.Shape.PlanKey): a length growing a token a step asks the core
    # for its workspace once a block, and each call still runs at its own length.
    monkeypatch.setattr(fake_binding, "PlanKeyQuantum", lambda: 32, raising=False)
    monkeypatch.setattr(fake_binding, "Workspace", lambda handle, seqlen: (
        fake_binding.calls.append(("Workspace", (handle, seqlen))), 8 * -(-seqlen // 32))[1])
    q, k, v = tensors()
    lengths = [1, 2, 31, 32, 33, 64, 65, 40, 0, 1000, 999]
    for n in lengths:
        flash_decode.flash_decode(q, k, v, cache_seqlens=n)
    assert [seqlen for _, seqlen in fake_binding.args("Workspace")] == [1, 33, 65, 0, 1000]
    runs = fake_binding.args("Run")
    assert [r[1] for r in runs] == lengths
    assert [r[9] for r in runs] == [8 * -(-n // 32) for n in lengths]
    # A negative length is refused whatever block it would fall in (the core would
    # read it as the whole cache); one past the cache is refused by Run's own check.
    with pytest.raises(ValueError, match=r"^cache_seqlens=-1 must not be negative"):
        flash_decode.flash_decode(q, k, v, cache_seqlens=-1)
    with pytest.raises(ValueError, match=r"^cache_seqlens=-40 must not be negative"):
        flash_decode.flash_decode(q, k, v, cache_seqlens=-40)


def test_workspaces_per_length_are_bounded(fake_binding, monkeypatch):
    monkeypatch.setattr(_api, "_WORKSPACES_LIMIT", 3)
    q, k, v = tensors()
    for n in range(10):
        flash_decode.flash_decode(q, k, v, cache_seqlens=n)
    (entry,) = _api._prepared.values()
    assert 1 <= len(entry[3]) <= 3
    assert [r[9] for r in fake_binding.args("Run")] == [8 * n for n in range(10)]


def test_max_seqlen_k_plans_for_its_power_of_two(fake_binding):
    # Run's seqlen is the core's sizing hint: the bound rounded up to a power of
    # two, capped at the capacity (1000); the workspace is asked once per power
    # of two (5, 7 and 8 share 8), and for 0 every time.
    q, k, v = tensors()
    lens = torch.tensor([5, 3], dtype=torch.int32)
    bounds = [5, 7, 8, 5, 9, 0, 1, 5000, 1000, 0, 1]
    for bound in bounds:
        flash_decode.flash_decode(q, k, v, cache_seqlens=lens, max_seqlen_k=bound)
    flash_decode.flash_decode(q, k, v, cache_seqlens=lens)
    runs = fake_binding.args("Run")
    assert [r[1] for r in runs] == [8, 8, 8, 8, 16, 0, 1, 1000, 1000, 0, 1, -1]
    assert [r[7] for r in runs] == [lens.data_ptr()] * len(runs)  # the lengths still come from the tensor
    assert [r[9] for r in runs] == [64, 64, 64, 64, 128, 0, 8, 8000, 8000, 0, 8, 1000]  # FakeBinding: 8 a key
    assert [w[1] for w in fake_binding.args("Workspace")] == [-1, 8, 16, 0, 1, 1000, 1000, 0]
    assert len(fake_binding.args("Prepare")) == 1  # the bound is not part of the layout


def test_bounds_with_one_key_plan_alike():
    # flash_decode keeps a max_seqlen_k's plan under _bound_key(bound): that is
    # only right while every bound with one key gets one length from _bound_seqlen.
    for capacity in (1, 7, 1000, 4096, 5000):
        for new in (0, 1, 3):
            planned = {}
            for bound in range(1, 3 * capacity + 2):
                seqlen = _api._bound_seqlen(bound, capacity, new)
                assert planned.setdefault(_api._bound_key(bound), seqlen) == seqlen, (capacity, new, bound)
            assert len(planned) == (3 * capacity).bit_length() + 1  # a key a power of two up to 3 * capacity + 1


@pytest.mark.parametrize("cache_seqlens, bound, exc, pattern", [
    ("tensor", True, TypeError, r"^max_seqlen_k must be an int, got bool"),
    ("tensor", 8.0, TypeError, r"^max_seqlen_k must be an int, got float"),
    ("tensor", -1, ValueError, r"^max_seqlen_k must not be negative"),
    (None, 8, ValueError, r"^max_seqlen_k needs cache_seqlens as a tensor"),
    (7, 8, ValueError, r"^max_seqlen_k is for a cache_seqlens tensor"),
])
def test_max_seqlen_k_refused(fake_binding, cache_seqlens, bound, exc, pattern):
    q, k, v = tensors()
    lens = torch.tensor([5, 3], dtype=torch.int32) if cache_seqlens == "tensor" else cache_seqlens
    good = 1 if cache_seqlens == "tensor" else None
    flash_decode.flash_decode(q, k, v, cache_seqlens=lens, max_seqlen_k=good)  # a good call first: nothing cached
    runs = len(fake_binding.args("Run"))
    with pytest.raises(exc, match=pattern):
        flash_decode.flash_decode(q, k, v, cache_seqlens=lens, max_seqlen_k=bound)
    assert len(fake_binding.args("Run")) == runs


@pytest.mark.parametrize("softmax_scale, sent", [(None, (0.0, True)), (0.5, (0.5, False)), (2, (2.0, False)),
                                                 (1e-50, (1e-50, False))])
def test_scale_sent_with_default_flag(fake_binding, softmax_scale, sent):
    # The core refuses an explicit scale that rounds to 0 in float32 (1e-50):
    # python/binding TestPrepareChecks. None alone means "the default".
    flash_decode.flash_decode(*tensors(), softmax_scale=softmax_scale)
    (prepared,) = fake_binding.args("Prepare")
    assert prepared[23:25] == sent and type(prepared[23]) is float


@pytest.mark.parametrize("text, exc", [
    ("flashdecode: decode: headdim: not supported: 100; supported: ...", NotImplementedError),
    ("flashdecode: plan: nheads_q: invalid argument: 12 is not a multiple of nheads_kv=5", ValueError),
    ("flashdecode: decode: invalid argument: nil Problem", ValueError),
    ("flashdecode: decode: out: invalid argument: bytes [0x10, 0x20) overlap q's [0x0, 0x40); ...", ValueError),
    ("flashdecode: decode: too many layouts: 65536 are prepared (...), the most one process holds", RuntimeError),
    ("flashdecode: launch fd_split_kv_f16_d128_r16: invalid argument (CUDA error 1)", RuntimeError),
    ("flashdecode: internal error (please report): panic: runtime error: invalid memory address", RuntimeError),
    ("flashdecode: counting CUDA devices: not supported", RuntimeError),
])
def test_translate(text, exc):
    err = _api._translate(RuntimeError(text))
    assert type(err) is exc and str(err) == text


_SIGINT_WITH_THREADS = """
import os, signal, sys, threading, time
import flash_decode

# Ctrl-C's handler, as a program started from a terminal has it (a job a shell starts in the
# background inherits SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)

calls = [0]
def loop():
    while True:
        flash_decode.plan(1, 1, 32, 8, 128, 32768, device=-1)  # into Go and back, GIL released there
        calls[0] += 1

for _ in range(4):
    threading.Thread(target=loop, daemon=True).start()
while calls[0] < 100:
    time.sleep(0.01)
start = time.monotonic()
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("no KeyboardInterrupt")
except KeyboardInterrupt:
    print(f"KeyboardInterrupt {time.monotonic() - start:.3f}", flush=True)
sys.exit(0)  # the daemon threads are still calling into Go while the interpreter finalizes
"""


@needs_extension
def test_sigint_while_threads_are_in_native_calls():
    # Ctrl-C reaches the main thread at once, and exiting with threads still inside the Go
    # core ends cleanly. (Daemon threads inside torch ops at exit can abort the process in
    # torch itself, flash_decode or not: stop and join worker threads before exiting.)
    child = run_python(_SIGINT_WITH_THREADS, FLASH_DECODE_FORCE_NATIVE=None)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    last = child.stdout.splitlines()[-1]
    assert last.startswith("KeyboardInterrupt ") and float(last.split()[1]) < 1.0, child.stdout
