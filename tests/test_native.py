"""Import, public API, native loading and what the torch layer sends to the
binding, on any machine (no GPU needed).

The Go extension links gorgonia.org/cu, which calls os.Exit(1) if cuInit fails,
so these tests run the risky parts in a child interpreter and check that it
survives. Where $FAKECUDA_DIR/libcuda.so.1 (a stand-in driver whose cuInit
succeeds and which reports no device) and the installed extension exist, the
real binding is loaded against it: planner, layouts, error mapping and the gc
fix. The calls the torch layer makes are checked against fakes.LayoutBinding.
"""

import inspect
import json
import types

import pytest
import torch

import flash_decode
from conftest import FAKECUDA, FAKEDEVICE, has_extension, run_python
from fakes import FIELDS, layout_binding  # noqa: F401  (a fixture)
from flash_decode import _api, _native

NO_DRIVER = "flash_decode needs an NVIDIA GPU with a CUDA driver"
needs_fakecuda = pytest.mark.skipif(not (FAKECUDA / "libcuda.so.1").exists(),
                                    reason=f"no stand-in driver at {FAKECUDA}/libcuda.so.1")
needs_extension = pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")
needs_fake_device = pytest.mark.skipif(not (FAKEDEVICE / "libcuda.so.1").exists(),
                                       reason=f"no fake-device driver at {FAKEDEVICE}")


def test_public_api():
    assert flash_decode.__all__ == ["flash_decode", "plan", "Decoder", "DecoderGraphs", "merge_states", "merge_state",
                                    "__version__"]
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
                        ("max_seqlen_k", None), ("batch_invariant", False), ("k_descale", None), ("v_descale", None),
                        ("sinks", None), ("cu_seqlens_q", None), ("max_seqlen_q", None)]
    params = inspect.signature(flash_decode.plan).parameters
    assert list(params)[:6] == ["batch", "seqlen_q", "nheads_q", "nheads_kv", "headdim", "seqlen_cache"]
    assert {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} == {
        "dtype", "num_splits", "device", "seqlen", "serving", "seqlen_new", "window_size", "rotary", "page_size",
        "lengths", "batch_invariant", "kv_dtype", "k_descale", "v_descale", "cu_seqlens_q"}
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
    with pytest.raises(TypeError, match="^flashdecode: plan: dtype: wrong type"):
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


# The layout of a plain call: q (1, 1, 32, 128) and caches (1, 32768, 8, 128), contiguous.
_PLAIN_LAYOUT = """
import json
import flash_decode
from flash_decode import _native
from records import prepare
b, G = _native.binding(), 1 << 30
q, kv = (4096, 4096, 128, 1), (32768 * 1024, 1024, 128, 1)
layout = dict(dtype=1, batch=1, seqlen_q=1, heads_q=32, heads_kv=8, head_dim=128, seqlen_cache=32768, q=q,
              k_cache=kv, v_cache=kv, out=q, window_left=-1, window_right=-1)
"""

_LAUNCH_THROUGH_THE_BINDING = _PLAIN_LAYOUT + """
h = prepare(b, dict(layout, num_splits=32), 0)
ws = b.Workspace(h, -1)
splits = b.Run(h, -1, 1 * G, 64 * G, 128 * G, 2 * G, 3 * G, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10 * G, ws, 0)
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
from flash_decode import _native
from records import layout_of, prepare
# The layout the torch layer sends for a paged append with rotary (CPU tensors: only their
# shapes and strides are read), then a call with made-up device addresses.
q = torch.empty(2, 1, 32, 128, dtype=torch.float16)
pages = torch.empty(512, 16, 8, 128, dtype=torch.float16)
new = torch.empty(2, 1, 8, 128, dtype=torch.float16)
cos = torch.empty(8192, 64, dtype=torch.float16)
lens, table = torch.empty(2, dtype=torch.int32), torch.empty(2, 256, dtype=torch.int32)
b, G = _native.binding(), 1 << 30
h = prepare(b, layout_of(q=q, k_cache=pages, v_cache=pages, k=new, v=new, rotary_cos=cos, rotary_sin=cos,
                         cache_seqlens=lens, block_table=table, causal=True, rotary_interleaved=False), 0)
ws = b.Workspace(h, -1)
splits = b.Run(h, -1, 1 * G, 64 * G, 128 * G, 2 * G, 0, 4 * G, 5 * G, 0, 0, 0, 6 * G, 7 * G, 8 * G, 9 * G,
               0, 0, 0, 0, 10 * G, ws, 0)
print(json.dumps(dict(splits=splits, ws=ws)))
"""


@needs_extension
@needs_fake_device
def test_serving_binding_launches_append_then_stage_1(tmp_path):
    # A serving layout through the binding (the record the torch layer packs, then Run): the append
    # kernel, then the paged form of the serving stage 1 (pages of 16) with as many splits as
    # Run reports, then the combine where it splits; all with programmatic dependent launch.
    ran, launches = launch_on_fake_device(_SERVING_LAUNCH_THROUGH_THE_BINDING, tmp_path)
    names = [launch[0] for launch in launches]
    assert names[:2] == ["fd_append_kv_f16", "fd_split_kv_paged_f16_d128_r16"], names
    assert int(launches[1][1]) == ran["splits"] and launches[1][2:4] == ["8", "2"]  # grid (splits, 8 heads, 2)
    combine = "fd_combine_f16_r4" if ran["splits"] <= 8 else "fd_combine_f16"  # a warp a row up to 8 splits
    assert names[2:] == ([combine] if ran["splits"] > 1 and launches[1][6] == "1" else [])
    assert ran["ws"] > 0  # the rotated q lives in the workspace
    assert all(launch[7] == "1" for launch in launches)


_HINTED_LAUNCH = _PLAIN_LAYOUT + """
h = prepare(b, dict(layout, device_lengths=1), 0)
for seqlen in (-1, 1000):  # the capacity's plan, then the plan for a bound of 1000 keys (planned as 1024)
    ws = b.Workspace(h, seqlen)
    b.Run(h, seqlen, 1 * G, 64 * G, 128 * G, 2 * G, 0, 4 * G, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10 * G, ws, 0)
plans = [flash_decode.plan(1, 1, 32, 8, 128, 32768, device=0, seqlen=n, lengths=True) for n in (None, 1000)]
print(json.dumps([[p["kernel"], p["grid"], p["cluster"], p["combine"]] for p in plans]))
"""


@needs_extension
@needs_fake_device
def test_a_length_bound_launches_its_own_plan(tmp_path):
    # With a cache_seqlens tensor, Run's seqlen is the bound (max_seqlen_k), which the core rounds
    # up to a power of two: the launch follows the plan for it, not the capacity's.
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
_api._device = lambda t: 0
_api._current_stream = lambda device: 0
cache = torch.zeros(1, 32768, 8, 128, dtype=torch.float16)
q, new = torch.zeros(1, 1, 32, 128, dtype=torch.float16), torch.zeros(1, 1, 8, 128, dtype=torch.float16)
lens = torch.zeros(1, dtype=torch.int32)
plans = []
for bound in (256, 200, 40000):
    flash_decode.flash_decode(q, cache, cache.clone(), new, new, cache_seqlens=lens, max_seqlen_k=bound)
    p = flash_decode.plan(1, 1, 32, 8, 128, 32768, seqlen=bound, seqlen_new=1, lengths=True, device=0)
    plans.append([p["kernel"], p["grid"], p["cluster"]])
try:  # the core refuses a negative bound by name
    flash_decode.flash_decode(q, cache, cache.clone(), new, new, cache_seqlens=lens, max_seqlen_k=-5)
except ValueError as err:
    plans.append(str(err))
print(json.dumps(plans))
"""


@needs_extension
@needs_fake_device
def test_plan_of_a_bound_with_new_tokens_is_the_plan_launched(tmp_path):
    # plan(seqlen=bound, lengths=True) plans the bound as max_seqlen_k is planned: rounded up to a
    # power of two, capped at the cache, the new tokens counted in it.
    (*plans, refused), launches = launch_on_fake_device(_BOUND_WITH_APPEND, tmp_path)
    assert "max_seqlen_k: invalid argument: -5" in refused, refused
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
    for device in (None, "cuda", torch.device("cuda")):
        with pytest.raises(RuntimeError, match="torch sees none; device=-1 plans for a default H200-like device"):
            flash_decode.plan(1, 1, 32, 8, 128, 1024, device=device)
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
import records
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
report["fields"] = native.LayoutFields()
# Prepare validates without a GPU; Workspace and Run need one (the stand-in has none).
q, kv = (32 * 128, 32 * 128, 128, 1), (1024 * 8 * 128, 8 * 128, 128, 1)
layout = dict(dtype=1, batch=1, seqlen_q=1, heads_q=32, heads_kv=8, head_dim=128, seqlen_cache=1024, q=q,
              k_cache=kv, v_cache=kv, out=q, window_left=-1, window_right=-1)
handle = lambda **changes: records.prepare(native, dict(layout, **changes), 0)
report["handle"], report["handle_again"] = handle(), handle()
run = lambda h, q, k, v, out: native.Run(h, -1, q, k, v, out, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
for name, call in [("prepare_scale", lambda: handle(scale=1e-50)),
                   ("prepare_stride", lambda: handle(k_cache=kv[:3] + (2,))),
                   ("workspace", lambda: native.Workspace(report["handle"], -1)),
                   ("run", lambda: run(report["handle"], 0, 1 << 24, 1 << 26, 1 << 28)),
                   ("run_handle", lambda: run(1 << 20, 16, 16, 16, 16)),
                   # out = q: refused before any GPU work
                   ("run_overlap", lambda: run(report["handle"], 1 << 20, 1 << 24, 1 << 26, 1 << 20))]:
    try:
        status = call()
        err = _native.error(native, status) if status < 0 else None
    except Exception as raised:
        err = raised
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
    # A Go GC per collection costs about 560 us; the bound leaves a loaded CI runner room.
    assert report["gc_collect0_us"] < 300, report["gc_collect0_us"]
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
    assert report["error_window"][0] == "ValueError" and ": window_size: invalid argument" in report["error_window"][1]
    assert report["error_serving"][0] == "TypeError" and report["error_serving"][1].startswith("serving")
    # The core's refusals name flash_decode's arguments (k.shape[1] is plan's seqlen_new, an int
    # cache_seqlens its seqlen), and no int past int64 reaches gopy.
    assert report["error_seqlen_new"][0] == "ValueError"
    assert ": k: invalid argument: 2000 new tokens (k.shape[1]) exceed seqlen_cache=1024" in report["error_seqlen_new"][1]
    assert report["error_seqlen"][0] == "ValueError"
    assert ": cache_seqlens: invalid argument: 1000 + 30 new tokens exceed seqlen_cache=1024" in report["error_seqlen"][1]
    assert report["error_int64"] == ["ValueError", f"num_splits={1 << 63} is out of range (a 64-bit int)"]

    assert report["error_heads"][0] == "ValueError" and "invalid argument" in report["error_heads"][1]
    assert report["error_batch"][0] == "ValueError"
    assert report["error_splits"][0] == "ValueError" and "num_splits: invalid argument" in report["error_splits"][1]
    assert report["error_headdim"][0] == "NotImplementedError" and "headdim: not supported" in report["error_headdim"][1]

    assert report["fields"] == ",".join(f"{name}:{kind}" for name, kind in FIELDS)  # what fakes.LayoutBinding reads
    assert report["handle"] > 0 and report["handle_again"] == report["handle"]
    assert report["prepare_scale"][0] == "ValueError" and "softmax_scale" in report["prepare_scale"][1]
    assert report["prepare_stride"][0] == "ValueError" and "k_cache" in report["prepare_stride"][1]
    assert report["workspace"][0] == "ValueError" and "no CUDA device 0" in report["workspace"][1]
    assert report["run"][0] == "ValueError" and ": q: " in report["run"][1]
    assert report["run_handle"][0] == "ValueError" and ": handle: " in report["run_handle"][1]
    assert report["run_overlap"][0] == "ValueError" and "out: invalid argument: bytes" in report["run_overlap"][1]


# ---- what the torch layer sends to the binding (fakes.LayoutBinding, CPU tensors) ----

def tensors(batch=2, seqlen_q=1, nheads_q=8, nheads_kv=2, headdim=64, seqlen_cache=1000):
    q = torch.zeros(batch, seqlen_q, nheads_q, headdim, dtype=torch.float16)
    k = torch.zeros(batch, seqlen_cache, nheads_kv, headdim, dtype=torch.float16)
    return q, k, torch.zeros_like(k)


def test_layout_prepared_once_workspace_from_binding(layout_binding):
    q, k, v = tensors()
    lens = torch.tensor([1000, 3], dtype=torch.int32)
    for _ in range(3):
        out, lse = flash_decode.flash_decode(q, k, v, cache_seqlens=lens, return_softmax_lse=True)
        assert out.shape == q.shape and lse.shape == (2, 8, 1)
    ((layout, device),) = layout_binding.args("Prepare")
    assert device == 0
    assert {name: value for name, value in layout.items() if value not in (0, (0, 0), (0, 0, 0, 0))} == dict(
        dtype=1, batch=2, seqlen_q=1, heads_q=8, heads_kv=2, head_dim=64, seqlen_cache=1000, device_lengths=1,
        q=(512, 512, 64, 1), k_cache=(128000, 128, 64, 1), v_cache=(128000, 128, 64, 1), out=(512, 512, 64, 1),
        window_left=-1, window_right=-1)
    # The first call learns the workspace size from the core; the later ones reuse it.
    assert layout_binding.args("Workspace") == [(1, -1)]
    runs = layout_binding.args("Run")
    assert len(runs) == 3
    for handle, seqlen, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seqlens, *serving, ws, ws_bytes, stream in runs:
        assert (handle, seqlen, q_ptr, k_ptr, v_ptr, seqlens) == (1, -1, q.data_ptr(), k.data_ptr(),
                                                                 v.data_ptr(), lens.data_ptr())
        assert out_ptr and lse_ptr and ws and ws_bytes == 1000 and serving == [0] * 12


@pytest.mark.parametrize("q_bhsd", [(2, 8, 1, 64), (2, 8, 3, 64)], ids=["contiguous but a size-1 stride", "strided"])
def test_out_is_one_dense_block_with_the_registered_strides(layout_binding, q_bhsd):
    # SDPA's (b, h, s, d) q passed as a view: with one query token it is
    # contiguous but for the stride of its dimension of size 1.
    q = torch.zeros(q_bhsd, dtype=torch.float16).transpose(1, 2)
    _, k, v = tensors(seqlen_q=q.shape[1])
    for _ in range(2):  # the first call registers the layout, the second takes the hot path
        out = flash_decode.flash_decode(q, k, v)
        assert out.shape == q.shape and out.is_contiguous()
        assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    registered = layout_binding.args("Prepare")[0][0]["out"]
    assert all(s == r for n, s, r in zip(out.shape, out.stride(), registered) if n > 1), (out.stride(), registered)


def test_int_cache_seqlens_passed_per_call(layout_binding):
    q, k, v = tensors()
    lengths = [700, 701, 700, 0, 1000, 701]
    for n in lengths:
        flash_decode.flash_decode(q, k, v, cache_seqlens=n, num_splits=4)
    assert len(layout_binding.args("Prepare")) == 1  # one layout for every length
    runs = layout_binding.args("Run")
    assert [r[1] for r in runs] == lengths and all(r[7] == 0 for r in runs)  # no lengths tensor
    # A call gets the largest workspace the layout has needed, asked of the core when it grows.
    assert [seqlen for _, seqlen in layout_binding.args("Workspace")] == [700, 701, 1000]
    assert [r[-2] for r in runs] == [5600, 5608, 5608, 5608, 8000, 8000]  # the workspace's bytes
    # The value is still checked on every call, however many came before.
    with pytest.raises(ValueError, match=r"^cache_seqlens=-1 must not be negative"):
        flash_decode.flash_decode(q, k, v, cache_seqlens=-1, num_splits=4)
    with pytest.raises(TypeError, match=r"^cache_seqlens"):
        flash_decode.flash_decode(q, k, v, cache_seqlens=True, num_splits=4)


def test_a_growing_length_asks_for_the_workspace_when_it_grows(layout_binding, monkeypatch):
    # A decode loop's length, a token a step: the core's workspace (made up here: one size for
    # each 32 keys) is asked for only when a call needs more than the last one got.
    monkeypatch.setattr(layout_binding, "need", lambda seqlen: 8 * -(-seqlen // 32))
    q, k, v = tensors()
    for n in range(1, 101):
        flash_decode.flash_decode(q, k, v, cache_seqlens=n)
    assert [seqlen for _, seqlen in layout_binding.args("Workspace")] == [1, 33, 65, 97]
    assert [r[1] for r in layout_binding.args("Run")] == list(range(1, 101))


def test_a_refusal_with_workspace_enough_is_raised_by_its_kind(layout_binding):
    q, k, v = tensors()
    flash_decode.flash_decode(q, k, v)
    (entry,) = _api._prepared.values()
    entry[0] = lambda *args: layout_binding.fail(2, "flashdecode: decode: q: no")  # the layout's Run
    with pytest.raises(NotImplementedError, match="^flashdecode: decode: q: no$"):
        flash_decode.flash_decode(q, k, v)
    assert layout_binding.args("Workspace") == [(1, -1), (1, -1)]  # asked once more, then raised


def test_max_seqlen_k_goes_to_the_core_as_it_is(layout_binding):
    # Run's seqlen is the bound itself (the core rounds it up to its plan); the lengths still
    # come from the tensor, and the bound is not part of the layout.
    q, k, v = tensors()
    lens = torch.tensor([5, 3], dtype=torch.int32)
    bounds = [5, 7, 8, 0, 5000]
    for bound in bounds:
        flash_decode.flash_decode(q, k, v, cache_seqlens=lens, max_seqlen_k=bound)
    flash_decode.flash_decode(q, k, v, cache_seqlens=lens)
    runs = layout_binding.args("Run")
    assert [r[1] for r in runs] == bounds + [-1]
    assert [r[7] for r in runs] == [lens.data_ptr()] * len(runs)
    assert len(layout_binding.args("Prepare")) == 1


@pytest.mark.parametrize("cache_seqlens, bound, exc, pattern", [
    ("tensor", True, TypeError, r"^max_seqlen_k must be an int, got bool"),
    ("tensor", 8.0, TypeError, r"^max_seqlen_k must be an int, got float"),
    ("tensor", -1, ValueError, r"^max_seqlen_k=-1 must not be negative"),  # -1 is "no bound" to the core
    (None, 8, ValueError, r"^max_seqlen_k needs cache_seqlens as a tensor"),
    (7, 8, ValueError, r"^max_seqlen_k is for a cache_seqlens tensor"),
])
def test_max_seqlen_k_refused(layout_binding, cache_seqlens, bound, exc, pattern):
    q, k, v = tensors()
    lens = torch.tensor([5, 3], dtype=torch.int32) if cache_seqlens == "tensor" else cache_seqlens
    good = 1 if cache_seqlens == "tensor" else None
    flash_decode.flash_decode(q, k, v, cache_seqlens=lens, max_seqlen_k=good)  # a good call first: nothing cached
    runs = len(layout_binding.args("Run"))
    with pytest.raises(exc, match=pattern):
        flash_decode.flash_decode(q, k, v, cache_seqlens=lens, max_seqlen_k=bound)
    assert len(layout_binding.args("Run")) == runs


@pytest.mark.parametrize("softmax_scale, sent", [(None, 0.0), (0.5, 0.5), (2, 2.0), (1e-50, 1e-50)])
def test_scale_sent_as_a_float(layout_binding, softmax_scale, sent):
    # 0 is the core's default (None); it refuses an explicit scale that rounds to 0 in float32
    # (1e-50): python/binding's tests.
    flash_decode.flash_decode(*tensors(), softmax_scale=softmax_scale)
    ((layout, _),) = layout_binding.args("Prepare")
    assert layout["scale"] == sent and type(layout["scale"]) is float


def test_a_zero_scale_is_not_the_default(layout_binding):
    with pytest.raises(ValueError, match=r"^softmax_scale=0.0 must be positive"):
        flash_decode.flash_decode(*tensors(), softmax_scale=0.0)
    assert layout_binding.calls == []


@pytest.mark.parametrize("kind, exc", [(1, ValueError), (2, NotImplementedError), (3, RuntimeError),
                                       (4, RuntimeError), (5, RuntimeError), (6, RuntimeError), (7, RuntimeError)])
def test_errors_raised_by_kind(kind, exc):
    text = "flashdecode: decode: what: the core's words"
    native = types.SimpleNamespace(ErrorKind=lambda status: kind, ErrorMessage=lambda status: text)
    err = _native.error(native, -3)
    assert type(err) is exc and str(err) == text


_FORKED_CHILD = """
import json, multiprocessing, warnings
import torch
import flash_decode
from flash_decode import _api

_api._device = lambda t: 0  # CPU tensors as the fake device's
_api._current_stream = lambda device: 0
q, k = torch.zeros(1, 1, 32, 128, dtype=torch.float16), torch.zeros(1, 64, 8, 128, dtype=torch.float16)


def calls(queue):
    for name, call in [("plan", lambda: flash_decode.plan(1, 1, 32, 8, 128, 1024, device=-1)),
                       ("decode", lambda: flash_decode.flash_decode(q, k, k))]:
        try:
            call()
            queue.put([name, "ok"])
        except Exception as err:
            queue.put([name, type(err).__name__, str(err)])


if __name__ == "__main__":
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a process with threads
    fork, report = multiprocessing.get_context("fork"), {}
    for when in ("before loading", "after loading"):
        if when == "after loading":
            calls(multiprocessing.Queue())  # the parent loads the Go runtime, and caches the layout
        queue = fork.Queue()
        child = fork.Process(target=calls, args=(queue,))
        child.start()
        child.join(30)
        if child.is_alive():
            child.kill()
        report[when] = [child.exitcode] + [queue.get(timeout=10) for _ in range(2) if child.exitcode == 0]
    print(json.dumps(report))
"""


@needs_extension
@needs_fake_device
def test_a_forked_child_is_refused_at_once():
    # Go's runtime does not survive fork without exec: a child of a parent that loaded it must
    # fail at once, saying to use spawn, not hang (join's timeout: a hang fails the test).
    # A child forked before the parent loaded it loads its own.
    child = run_python(_FORKED_CHILD, LD_LIBRARY_PATH=str(FAKEDEVICE), FLASH_DECODE_FORCE_NATIVE=None)
    assert child.returncode == 0, child.stderr[-2000:]
    report = json.loads(child.stdout.splitlines()[-1])
    assert report["before loading"] == [0, ["plan", "ok"], ["decode", "ok"]]
    exitcode, *calls = report["after loading"]
    assert exitcode == 0 and [c[:2] for c in calls] == [["plan", "RuntimeError"], ["decode", "RuntimeError"]]
    assert all("spawn start method" in c[2] for c in calls), calls


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
    # At once: the signal comes within the 5 s sleep, typically in milliseconds; the bound
    # leaves a loaded CI runner room.
    assert last.startswith("KeyboardInterrupt ") and float(last.split()[1]) < 3.0, child.stdout
