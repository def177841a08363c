"""Shared test setup: the `cuda` marker, the SDPA reference, subprocess helpers,
and a stand-in for the Go extension that CPU tests of the torch layer use.

Tests marked `cuda` skip cleanly where torch sees no GPU; everything else runs
everywhere (CI has no GPU). flash_decode is imported from the installed package,
or from python/ in a source tree that was not installed (no native extension:
tests that need it skip).
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import standin

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Where the stand-in libcuda.so.1 of python/build_backend/make_libcuda.py lies (FAKECUDA_DIR; .ci/run
# sets it, else tests/standin.py builds it), and its fake-device build (make_libcuda.py
# --fake-device: one device that launches nothing and logs each launch; FAKEDEVICE_DIR).
FAKECUDA = standin.driver_dir("FAKECUDA_DIR")
FAKEDEVICE = standin.driver_dir("FAKEDEVICE_DIR", fake_device=True)

if importlib.util.find_spec("flash_decode") is None:
    sys.path.insert(0, str(ROOT / "python"))

import flash_decode  # noqa: E402  (after the path fallback above)

HAS_GPU = torch.cuda.is_available()
PACKAGE_PARENT = str(pathlib.Path(flash_decode.__file__).resolve().parent.parent)


def has_extension():
    """Whether the gopy extension is installed. Looked up on disk: importing it
    (or a parent package of it) is what must not happen on a driverless machine."""
    from flash_decode import _native
    top = _native.BINDING_MODULE.split(".")[1]   # e.g. "_binding"
    package = pathlib.Path(flash_decode.__file__).parent
    return (package / top).is_dir() or any(package.glob(top + ".*"))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class FakeBinding:
    """Stands in for the Go extension in CPU tests of the torch layer: records
    every call. Prepare gives each distinct layout a handle, Workspace answers
    1000 bytes for the whole cache and 8 per key of an int length (made-up
    sizes that tell the calls apart, so PlanKeyQuantum is 1: lengths do not
    share a size), Run launches nothing."""

    def __init__(self):
        self.calls = []
        self.handles = {}

    def Prepare(self, *args):
        self.calls.append(("Prepare", args))
        return self.handles.setdefault(args, len(self.handles))

    def PlanKeyQuantum(self):
        return 1  # every length its own workspace size, so that tests see each one asked for

    def Workspace(self, handle, seqlen):
        self.calls.append(("Workspace", (handle, seqlen)))
        return 1000 if seqlen < 0 else 8 * seqlen

    def Run(self, *args):
        self.calls.append(("Run", args))
        return 1

    def args(self, name):
        """The arguments of every call to name, in order."""
        return [args for called, args in self.calls if called == name]


@pytest.fixture
def fake_binding(monkeypatch):
    """flash_decode over a FakeBinding, with an empty layout cache, on CPU
    tensors: they pass the device check as CUDA device 0."""
    from flash_decode import _api, _native
    fake = FakeBinding()
    monkeypatch.setattr(_native, "binding", lambda: fake)
    monkeypatch.setattr(_api, "_prepared", {})
    monkeypatch.setattr(_api, "_check_devices", lambda q, **others: 0)
    monkeypatch.setattr(_api, "_current_stream", lambda device: 0)
    return fake


def run_python(code, **env):
    """Run code in a fresh interpreter that imports this flash_decode; env adds
    (or, with value None, removes) environment variables. Returns the
    CompletedProcess; the child's crash or os.Exit shows in returncode."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [PACKAGE_PARENT] + ([child_env["PYTHONPATH"]] if child_env.get("PYTHONPATH") else []))
    for key, value in env.items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    return subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                          text=True, timeout=120)


def reference(q, k, v, cache_seqlens=None, causal=False, softmax_scale=None):
    """Attention by torch SDPA in fp32 on the same (upcast) inputs, with an
    explicit boolean mask: ragged lengths, bottom-right causal, GQA/MQA by
    repeating K/V heads. Rows that see no key give out = 0 and lse = -inf.

    Returns (out (b, sq, hq, d) fp32, lse (b, hq, sq) fp32).
    """
    b, sq, hq, d = q.shape
    seqlen_cache, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / d ** 0.5 if softmax_scale is None else softmax_scale
    if cache_seqlens is None:
        cache_seqlens = seqlen_cache
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    lens = cache_seqlens.to(q.device, torch.int64).clamp(0, seqlen_cache).view(b, 1, 1)
    keys = torch.arange(seqlen_cache, device=q.device).view(1, 1, -1)
    mask = keys < lens                                         # (b, sq or 1, L)
    if causal:
        rows = torch.arange(sq, device=q.device).view(1, -1, 1)
        mask = mask & (keys <= lens - sq + rows)
    mask = mask.expand(b, sq, seqlen_cache).unsqueeze(1)       # (b, 1, sq, L)

    group = hq // hkv
    qf = q.float().transpose(1, 2)                             # (b, hq, sq, d)
    kf = k.float().repeat_interleave(group, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(group, dim=2).transpose(1, 2)
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=mask, scale=scale)
    seen = mask.any(-1, keepdim=True)                          # rows with at least one key
    out = torch.where(seen, out, torch.zeros_like(out)).transpose(1, 2)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return out, lse


# Output tolerances for fp16/bf16 results against the fp32 reference on the same
# inputs (about 2-3 ulps of the output dtype); the LSE is fp32 throughout.
OUT_TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = {torch.float16: dict(atol=2e-3, rtol=1e-3), torch.bfloat16: dict(atol=1e-2, rtol=1e-3)}


def assert_matches_reference(out, lse, q, k, v, **kwargs):
    """Compare flash_decode's out (and lse, if not None) with reference(q, k, v, **kwargs)."""
    ref_out, ref_lse = reference(q, k, v, **kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref_out, **OUT_TOL[q.dtype])
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
        torch.testing.assert_close(lse, ref_lse, **LSE_TOL[q.dtype])


def assert_names(err, exc, name):
    """err is exactly exc and names argument name: Python's messages start
    with it, the Go core's read "flashdecode: <op>: <name>: ..."."""
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    assert re.match(rf"(?:flashdecode: \w+: )?{name}\b", str(err)), f"message does not name {name!r}: {err}"
