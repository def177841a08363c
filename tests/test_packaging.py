"""The installed package as a wheel delivers it, on any machine (no GPU needed).

The planner is pure Go, but the extension links gorgonia.org/cu and so needs a
libcuda.so.1 whose cuInit succeeds: where none loads, _native.binding(planner_only=True)
loads the stand-in the wheel carries. The extension must carry no build-machine run
path and no symbol tables, and the wheel the licenses of what it links.
"""

import inspect
import json
import pathlib
import re
import shutil
import subprocess
from importlib import metadata

import pytest

import flash_decode
from conftest import has_extension, run_python

NO_DRIVER = "flash_decode needs an NVIDIA GPU with a CUDA driver"
PACKAGE = pathlib.Path(flash_decode.__file__).resolve().parent
needs_extension = pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")
needs_readelf = pytest.mark.skipif(shutil.which("readelf") is None, reason="no readelf (binutils)")

# Planned without a driver, then a decode call, in a fresh interpreter with every GPU hidden:
# on a driverless machine the stand-in serves, on a GPU machine the driver (with no device).
_NO_DRIVER_PROBE = """
import ctypes, json, warnings
import torch, flash_decode
from flash_decode import _native, _api

report = {}
try:
    ctypes.CDLL("libcuda.so.1")
    report["driver"] = True
except OSError:
    report["driver"] = False
report["plan"] = flash_decode.plan(1, 1, 32, 8, 128, 32768, device=-1)
report["standin"] = any(_native.STANDIN in line for line in open("/proc/self/maps"))
try:
    _native.binding()
except RuntimeError as err:
    report["binding"] = str(err)
_api._device = lambda t: 0  # CPU tensors as CUDA device 0's: the call reaches the native door
q = torch.zeros(1, 1, 32, 128, dtype=torch.float16)
k = torch.zeros(1, 64, 8, 128, dtype=torch.float16)
try:
    flash_decode.flash_decode(q, k, k)
except RuntimeError as err:
    report["decode"] = str(err)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report["torch_cuda"] = torch.cuda.is_available()
report["torch_warnings"] = [str(w.message) for w in caught]
print(json.dumps(report))
"""


@needs_extension
def test_plan_without_driver_and_decode_still_refuses():
    child = run_python(_NO_DRIVER_PROBE, CUDA_VISIBLE_DEVICES="", LD_LIBRARY_PATH=None,
                       FLASH_DECODE_FORCE_NATIVE=None)
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    # docs/api.md's answer to "what does num_splits=0 pick" for b=1, 32/8 heads, d128, 32K tokens.
    expected = {"num_splits": 16, "grid": [16, 8, 1], "cluster": 1, "workspace_bytes": 264192,
                "kernel": "fd_split_kv_f16_d128_r16", "combine": "fd_combine_f16"}
    assert {k: report["plan"][k] for k in expected} == expected
    # Every GPU is hidden: with no driver, or with one whose cuInit finds no device, planning
    # goes through the stand-in.
    assert report["standin"]
    for key in ("binding", "decode"):
        assert report[key].startswith(NO_DRIVER), report[key]
        assert ("could not be loaded" if not report["driver"] else "no CUDA device") in report[key]
    # With the stand-in in the process, torch finds a driver without a device, quietly.
    assert report["torch_cuda"] is False and report["torch_warnings"] == []


def _readelf(*args):
    return subprocess.run(["readelf", "-W", *args], capture_output=True, text=True, check=True).stdout


def _extension():
    found = sorted((PACKAGE / "_binding").glob("_binding.*.so"))
    assert len(found) == 1, found
    return found[0]


@needs_extension
@needs_readelf
def test_extension_is_stripped_without_run_path():
    ext = _extension()
    dynamic = _readelf("-d", str(ext))
    assert "(NEEDED)" in dynamic and "[libcuda.so.1]" in dynamic
    assert "(RPATH)" not in dynamic and "(RUNPATH)" not in dynamic, dynamic
    sections = _readelf("-S", str(ext))
    assert " .dynsym " in sections  # the parse found the section table
    assert " .symtab " not in sections and " .debug_" not in sections


@needs_extension
@needs_readelf
def test_standin_libcuda_is_shipped():
    from flash_decode import _native
    standin = pathlib.Path(_native.STANDIN)
    assert standin.parent == PACKAGE / "_binding" and standin.name != "libcuda.so.1"
    assert "Library soname: [libcuda.so.1]" in _readelf("-d", str(standin))
    symbols = _readelf("--dyn-syms", str(standin))
    for name in ("cuInit", "cuDeviceGetCount", "cuGetProcAddress_v2"):
        assert re.search(rf" FUNC .* {name}$", symbols, re.M), name


@needs_extension
def test_licenses_are_shipped():
    licenses = PACKAGE / "_binding" / "licenses"
    for module in ("go", "gorgonia.org/cu", "github.com/go-python/gopy"):
        files = list((licenses / module).iterdir())
        assert files and all(f.stat().st_size > 200 for f in files), module
    assert "Apache License" in (licenses / "gorgonia.org/cu" / "LICENSE").read_text()
    try:
        dist = metadata.distribution("flash-decode")
    except metadata.PackageNotFoundError:
        pytest.skip("flash-decode is not installed (a source tree)")
    assert dist.metadata["License-Expression"] == "Apache-2.0"
    license_file = next(f for f in dist.files if f.name == "LICENSE" and "dist-info" in str(f))
    assert "Apache License" in license_file.read_text()


def test_public_api_is_typed():
    # PEP 561: the marker ships with the package, and every annotation of the public
    # functions resolves (they are strings until asked for).
    import typing

    import torch
    assert (PACKAGE / "py.typed").is_file()
    for fn in (flash_decode.flash_decode, flash_decode.plan, flash_decode.merge_states, flash_decode.merge_state):
        hints = typing.get_type_hints(fn)
        params = [p for p in inspect.signature(fn).parameters]
        assert set(params) | {"return"} == set(hints), fn.__name__
    hints = typing.get_type_hints(flash_decode.flash_decode)
    assert hints["q"] is torch.Tensor and hints["cache_seqlens"] == int | torch.Tensor | None
    assert hints["return"] == torch.Tensor | tuple[torch.Tensor, torch.Tensor]
