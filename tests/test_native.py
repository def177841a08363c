"""Import, public API and native loading, on any machine (no GPU needed).

The Go extension links gorgonia.org/cu, which calls os.Exit(1) if cuInit fails,
so these tests run the risky parts in a child interpreter and check that it
survives. Where tests/fakecuda/libcuda.so.1 (a stand-in driver whose cuInit
succeeds and which reports no device) and the installed extension exist, the
real binding is loaded against it: planner, error mapping and the gc fix.
"""

import inspect
import json

import pytest
import torch

import flash_decode
from conftest import FAKECUDA, has_extension, run_python

NO_DRIVER = "flash_decode needs an NVIDIA GPU with a CUDA driver"
needs_fakecuda = pytest.mark.skipif(not (FAKECUDA / "libcuda.so.1").exists(),
                                    reason=f"no stand-in driver at {FAKECUDA}/libcuda.so.1")
needs_extension = pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")


def test_public_api():
    assert flash_decode.__all__ == ["flash_decode", "plan", "__version__"]
    assert isinstance(flash_decode.__version__, str)
    params = inspect.signature(flash_decode.flash_decode).parameters
    assert list(params)[:3] == ["q", "k_cache", "v_cache"]
    keywords = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == dict(cache_seqlens=None, softmax_scale=None, causal=False, num_splits=0,
                            return_softmax_lse=False, out=None)
    params = inspect.signature(flash_decode.plan).parameters
    assert list(params)[:6] == ["batch", "seqlen_q", "nheads_q", "nheads_kv", "headdim", "seqlen_cache"]
    assert {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} == {
        "dtype", "num_splits", "device", "seqlen"}
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


@pytest.mark.parametrize("plan_args", ["device=-1", "device=0"])
def test_no_gpu_raises_runtime_error(plan_args):
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on GPU machines too.
    child = run_python(
        "import sys, flash_decode\n"
        "from flash_decode import _native\n"
        "for attempt in range(2):\n"
        "    try:\n"
        f"        flash_decode.plan(1, 1, 32, 8, 128, 1024, {plan_args})\n"
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
    with pytest.raises(ValueError, match="^num_splits"):
        flash_decode.plan(1, 1, 32, 8, 128, 1024, num_splits=-2)


@needs_fakecuda
def test_fake_driver_without_device():
    child = run_python(
        "import sys, flash_decode\n"
        "from flash_decode import _native\n"
        "try:\n"
        "    flash_decode.plan(1, 1, 32, 8, 128, 1024, device=-1)\n"
        "except RuntimeError as err:\n"
        "    print(err)\n"
        "assert _native.BINDING_MODULE not in sys.modules\n",
        LD_LIBRARY_PATH=str(FAKECUDA), FLASH_DECODE_FORCE_NATIVE=None)
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith(NO_DRIVER) and "no CUDA device" in child.stdout


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
for name, args in [("heads", (1, 1, 12, 5, 128, 1024)), ("batch", (0, 1, 32, 8, 128, 1024))]:
    try:
        flash_decode.plan(*args, device=-1)
    except Exception as err:
        report["error_" + name] = [type(err).__name__, str(err)]
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
    assert p["num_splits"] == 40 and p["cluster"] == 1 and p["combine_grid"] == 2 * 40 * 4
    # more than 32 splits: the 16-warp combine, which loads them all in one round trip
    assert p["combine"].endswith("_w16") and p["combine_threads"] == 512
    assert p["workspace_bytes"] >= 40 * (2 * 40 * 4) * 128 * 4  # splits * rows * headdim * fp32

    assert report["error_heads"][0] == "ValueError" and "invalid argument" in report["error_heads"][1]
    assert report["error_batch"][0] == "ValueError"
