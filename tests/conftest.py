"""Shared test setup: the `cuda` marker, the SDPA reference, subprocess helpers,
and a stand-in for the Go extension that CPU tests of the torch layer use.

Tests marked `cuda` skip cleanly where torch sees no GPU; everything else runs
everywhere (CI has no GPU). flash_decode is imported from the installed package,
or from python/ in a source tree that was not installed (no native extension:
tests that need it skip).
"""

import contextlib
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


@pytest.fixture(autouse=True)
def seeded_torch():
    """Every test starts from the same torch RNG state, so that those drawing
    without a generator of their own are reproducible too."""
    torch.manual_seed(0)


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
    sizes that tell the calls apart: lengths do not share a size), Run
    launches nothing."""

    def __init__(self):
        self.calls = []
        self.handles = {}

    def Prepare(self, *args):
        self.calls.append(("Prepare", args))
        return self.handles.setdefault(args, len(self.handles))

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
    monkeypatch.setattr(_native, "binding", lambda planner_only=False: fake)
    monkeypatch.setattr(_api, "_prepared", {})
    monkeypatch.setattr(_api, "_device", lambda t: 0)
    monkeypatch.setattr(_api, "_current_stream", lambda device: 0)
    return fake


@pytest.fixture
def real_binding():
    """The built extension, for planning (skips where it is not built)."""
    from flash_decode import _native
    if not has_extension():
        pytest.skip("needs the built extension")
    return _native.binding(planner_only=True)


def run_python(code, **env):
    """Run code in a fresh interpreter that imports this flash_decode; env adds
    (or, with value None, removes) environment variables. Returns the
    CompletedProcess; the child's crash or os.Exit shows in returncode."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(  # tests/ too: records.py
        [PACKAGE_PARENT, str(ROOT / "tests")] + ([child_env["PYTHONPATH"]] if child_env.get("PYTHONPATH") else []))
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


# Fixed tolerances for fp16/bf16 results against an fp32 reference (about 2-3 ulps
# of the output dtype), for comparisons that assert_close_to_reference's bounds
# do not model; the LSE is fp32 throughout.
OUT_TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
LSE_TOL = {torch.float16: dict(atol=2e-3, rtol=1e-3), torch.bfloat16: dict(atol=1e-2, rtol=1e-3)}

# Bounds from the data (core/cuda/tolerance_test.go has the same): an output
# element may be off by OUT_STEPS rounding steps of its dtype, taken at its own
# size plus its row's RMS (the size of the rounding noise of P in P V, which the
# kernels keep in the input dtype), and the LSE by LSE_REL of its size (at least 1).
# A long row with one key tile or split left out is further off (test_bounds.py).
OUT_STEPS = 4
LSE_REL = 1e-4
STEP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}  # spacing of the dtype's values in [1, 2)


def bound_errors(out, lse, ref_out, ref_lse, dtype):
    """The values of out (..., headdim) and lse past their bounds around the fp32
    reference, as a message; "" where every one is within them."""
    ref_out = ref_out.to(out.device)
    rms = ref_out.pow(2).mean(-1, keepdim=True).sqrt()
    bound = OUT_STEPS * STEP[dtype] * (ref_out.abs() + rms) + 2.0 ** -24
    ratio = (out.float() - ref_out).abs() / bound
    ratio = torch.where(torch.isnan(ratio), torch.inf, ratio)
    messages = []
    bad = ~(ratio <= 1)
    if bad.any():
        at = tuple(int(i) for i in bad.nonzero()[0])
        messages.append(f"{int(bad.sum())} of {out.numel()} out values past their bounds, worst "
                        f"{float(ratio.max()):.3g} x; first at {at}: {float(out[at])} vs {float(ref_out[at])}")
    if lse is not None:
        ref_lse = ref_lse.to(lse.device)
        both_empty = torch.isneginf(lse) & torch.isneginf(ref_lse)
        ratio = (lse - ref_lse).abs() / (LSE_REL * ref_lse.abs().clamp(min=1))
        bad = ~(both_empty | (ratio <= 1))
        if bad.any():
            at = tuple(int(i) for i in bad.nonzero()[0])
            messages.append(f"{int(bad.sum())} of {lse.numel()} lse values past their bounds; first at {at}: "
                            f"{float(lse[at])} vs {float(ref_lse[at])}")
    return "; ".join(messages)


def assert_matches_reference(out, lse, q, k, v, **kwargs):
    """Compare flash_decode's out (and lse, if not None) with reference(q, k, v, **kwargs)
    within bound_errors' bounds."""
    ref_out, ref_lse = reference(q, k, v, **kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    errors = bound_errors(out, lse, ref_out, ref_lse, q.dtype)
    assert not errors, errors


def plant(q, k, cache_seqlens=None):
    """Make keys n - 1, n - seqlen_q and n // 2 of each sequence (n its length) the
    largest scores of its rows, in place: a sequence's q rows of a K/V head take the
    signs of the first one, and those keys are the signs (+-1), scoring about
    0.8 sqrt(headdim) against about 4 for the best of 32K random keys. A kernel that
    skips the last key tile, or the split holding either key, is then far off."""
    b, sq, hq, d = q.shape
    seqlen_cache, hkv = k.shape[1], k.shape[2]
    if cache_seqlens is None or isinstance(cache_seqlens, int):
        cache_seqlens = [seqlen_cache if cache_seqlens is None else cache_seqlens] * b
    rows = q.view(b, sq, hkv, hq // hkv, d)
    sign = torch.where(rows[:, :1, :, :1] < 0, -1.0, 1.0).to(q.dtype)  # (b, 1, hkv, 1, d)
    rows.copy_(rows.abs() * sign)
    for i, n in enumerate(int(n) for n in cache_seqlens):
        n = max(0, min(n, seqlen_cache))
        for j in {n - 1, n - sq, n // 2}:
            if 0 <= j < n:
                k[i, j] = sign[i, 0, :, 0]


def assert_names(err, exc, name):
    """err is exactly exc and names argument name: Python's messages start
    with it, the Go core's read "flashdecode: <op>: <name>: ..."."""
    assert type(err) is exc, f"{type(err).__name__}: {err}"
    assert re.match(rf"(?:flashdecode: \w+: )?{name}\b", str(err)), f"message does not name {name!r}: {err}"


def capture(call):
    """call() warmed up on a side stream (plans, module load), then captured in a CUDA graph:
    returns (graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = call()
    return graph, result


def load_example(name):
    """examples/<name>.py imported as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def cpu_kernels(kernels):
    """flash_decode's custom ops given CPU kernels (op name -> function) for a block, with
    torch.compile's caches reset around it; disabled after it, so that a CPU call reaches the CUDA
    kernel's device check again."""
    from flash_decode import _ops
    for name, fn in kernels.items():
        torch.library.register_kernel(f"flash_decode::{name}", "cpu", fn)
        getattr(_ops, name).set_kernel_enabled("cpu", True)
    torch._dynamo.reset()
    try:
        yield
    finally:
        for name in kernels:
            getattr(_ops, name).set_kernel_enabled("cpu", False)
        torch._dynamo.reset()
