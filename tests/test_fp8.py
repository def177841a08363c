"""fp8 KV caches (torch.float8_e4m3fn, torch.float8_e5m2) under fp16/bf16 queries, with
FA3's k_descale and v_descale.

CPU: what the torch layer sends to the binding (a stand-in reads the layout back), the
refusals it decides and those the core decides (through the real binding where it is
built), plan() of fp8 layouts, the custom ops' descale arguments under torch.compile,
and torch's own quantization, the yardstick of the appends: round to nearest even,
saturated at the format's largest value.

GPU: every form and argument against an fp32 reference on the dequantized cache
(k8.float() * k_descale), within conftest.bound_errors' bounds and FA's rule: at most
3x the error of the same math in fp16 (flash_decode on the dequantized cache in q's
dtype); appended tokens equal torch's (x / descale).clamp(-max, max).to(fp8) bit for
bit, after rotary (in fp32, rounded to q's dtype); CUDA-graph replay; torch.compile.
"""

import math

import pytest
import torch

import flash_decode
from conftest import FAKECUDA, ROOT, assert_names, bound_errors, cpu_kernels, has_extension, run_python
from fakes import layout_binding  # noqa: F401  (a fixture)
from serving_ref import apply_rotary, make_paged, reference_kvcache, rotary_tables
from test_serving import check_refused

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
CODES = {torch.float8_e4m3fn: 4, torch.float8_e5m2: 5}  # the layout's kv_dtype
DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]

needs_extension = pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")


def quantize(x, descale, fp8):
    """torch's own quantization of x into fp8 by descale (broadcastable): x / descale in fp32,
    clamped to the format's range, rounded to nearest even."""
    m = FP8_MAX[fp8]
    return (x.float() / descale).clamp(-m, m).to(fp8)


def same_bits(a, b):
    """fp8 (or any) tensors equal byte for byte, NaNs included."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---- torch's quantization: the rounding the appends must give ----

@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_torch_quantization_is_rne_saturated(fp8):
    e4m3 = fp8 == torch.float8_e4m3fn
    cases = [  # (x, value it rounds to, its code)
        (448.0, 448.0, 0x7E) if e4m3 else (57344.0, 57344.0, 0x7B),
        (1e6, 448.0, 0x7E) if e4m3 else (1e9, 57344.0, 0x7B),      # saturates (no inf, no NaN)
        (464.0, 448.0, 0x7E) if e4m3 else (61440.0, 57344.0, 0x7B),  # the tie past the largest value
        (-1e6, -448.0, 0xFE) if e4m3 else (-1e9, -57344.0, 0xFB),
        (1.0, 1.0, 0x38) if e4m3 else (1.0, 1.0, 0x3C),
        (1.0625, 1.0, 0x38) if e4m3 else (1.125, 1.0, 0x3C),         # tie: to the even code
        (1.1875, 1.25, 0x3A) if e4m3 else (1.375, 1.5, 0x3E),        # tie: to the even code
        (2.0 ** -9, 2.0 ** -9, 0x01) if e4m3 else (2.0 ** -16, 2.0 ** -16, 0x01),  # smallest subnormal
        (2.0 ** -10, 0.0, 0x00) if e4m3 else (2.0 ** -17, 0.0, 0x00),  # tie with 0
        (3 * 2.0 ** -10, 2.0 ** -8, 0x02) if e4m3 else (3 * 2.0 ** -17, 2.0 ** -15, 0x02),
        (2.0 ** -6, 2.0 ** -6, 0x08) if e4m3 else (2.0 ** -14, 2.0 ** -14, 0x04),  # smallest normal
    ]
    x = torch.tensor([c[0] for c in cases])
    q = quantize(x, 1.0, fp8)
    assert q.float().tolist() == [c[1] for c in cases]
    assert q.view(torch.uint8).tolist() == [c[2] for c in cases]
    assert torch.isnan(quantize(torch.tensor([math.nan]), 1.0, fp8).float()).all()
    assert quantize(torch.tensor([math.inf]), 1.0, fp8).float().item() == FP8_MAX[fp8]


# ---- what the torch layer sends to the binding (a stand-in, CPU tensors) ----

B, SQ, HQ, HKV, D, L = 2, 1, 8, 2, 64, 48


def fp8_args(device="cpu", fp8=torch.float8_e4m3fn, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, SQ, HQ, D, generator=g).to(device, dtype)
    k8 = quantize(torch.randn(B, L, HKV, D, generator=g), 0.05, fp8).to(device)
    v8 = quantize(torch.randn(B, L, HKV, D, generator=g), 0.05, fp8).to(device)
    return dict(q=q, k_cache=k8, v_cache=v8, cache_seqlens=torch.tensor([L, 7], dtype=torch.int32, device=device))


def call(args):
    args = dict(args)
    return flash_decode.flash_decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fp8_cache_layout(layout_binding, fp8, dtype):
    a = fp8_args(fp8=fp8, dtype=dtype)
    call(a)
    ((layout, _),) = layout_binding.args("Prepare")
    assert layout["kv_dtype"] == CODES[fp8] and layout["dtype"] == (1 if dtype == torch.float16 else 2)
    assert layout["k_cache"] == (L * HKV * D, HKV * D, D, 1)  # strides in elements: bytes, for fp8
    assert layout["descale"] == 0 and layout["k_descale_value"] == layout["v_descale_value"] == 0.0
    ((_, _, *pointers, _, _, _),) = layout_binding.args("Run")
    assert pointers[14:16] == [0, 0]


def test_float_descales_go_in_the_layout(layout_binding):
    a = fp8_args()
    call(dict(a, k_descale=0.5, v_descale=2))
    ((layout, _),) = layout_binding.args("Prepare")
    assert (layout["k_descale_value"], layout["v_descale_value"], layout["descale"]) == (0.5, 2.0, 0)
    assert layout["k_descale"] == layout["v_descale"] == (0, 0)
    ((_, _, *pointers, _, _, _),) = layout_binding.args("Run")
    assert pointers[14:16] == [0, 0]
    call(dict(a, k_descale=0.5))  # v_descale None: 1
    assert layout_binding.args("Prepare")[1][0]["v_descale_value"] == 0.0


@pytest.mark.parametrize("shape", [(1,), (), (1, 1), (B, HKV)], ids=["1", "scalar", "1x1", "batch-heads"])
def test_descale_tensors_go_as_addresses(layout_binding, shape):
    a = fp8_args()
    kd, vd = torch.full(shape, 0.5), torch.full(shape, 0.25)
    call(dict(a, k_descale=kd, v_descale=vd))
    ((layout, _),) = layout_binding.args("Prepare")
    strides = kd.stride() if shape == (B, HKV) else (0, 0)
    assert layout["descale"] == 1 and layout["k_descale"] == layout["v_descale"] == strides
    assert layout["k_descale_value"] == layout["v_descale_value"] == 0.0
    ((_, _, *pointers, _, _, _),) = layout_binding.args("Run")
    assert pointers[14:17] == [kd.data_ptr(), vd.data_ptr(), 0]


def test_transposed_descale_tensor_keeps_its_strides(layout_binding):
    kd = torch.rand(HKV, B).t()  # (batch, heads_kv), strides (1, batch)
    call(dict(fp8_args(), k_descale=kd, v_descale=kd.contiguous()))
    ((layout, _),) = layout_binding.args("Prepare")
    assert layout["k_descale"] == (1, B) and layout["v_descale"] == (HKV, 1)


def test_fp8_layout_prepared_once(layout_binding):
    a = fp8_args()
    kd = torch.rand(B, HKV)
    for _ in range(3):
        call(dict(a, k_descale=kd, v_descale=kd))
    call(dict(a, k_descale=kd.clone(), v_descale=kd.clone()))  # new tensors, the same layout
    assert len(layout_binding.args("Prepare")) == 1 and len(layout_binding.args("Run")) == 4
    call(dict(a, k_descale=0.5, v_descale=0.5))
    call(dict(a, k_descale=0.5, v_descale=0.5))
    call(dict(a, k_descale=0.25, v_descale=0.5))  # another value: another layout
    assert len(layout_binding.args("Prepare")) == 3
    # After a good call with a float, a bool (equal as a key) is still refused.
    call(dict(a, k_descale=1.0, v_descale=1.0))
    with pytest.raises(TypeError) as info:
        call(dict(a, k_descale=True, v_descale=1.0))
    assert_names(info.value, TypeError, "k_descale")


def test_fp8_append_layout(layout_binding):
    a = fp8_args()
    k = torch.randn(B, 2, HKV, D, dtype=torch.float16)
    call(dict(a, k=k, v=k.clone(), cache_seqlens=torch.tensor([3, 7], dtype=torch.int32), k_descale=0.5))
    ((layout, _),) = layout_binding.args("Prepare")
    assert layout["seqlen_new"] == 2 and layout["kv_dtype"] == 4 and layout["k_descale_value"] == 0.5


def replace(**kw):
    return lambda a: a.update(kw)


def retyped(name, dtype):
    return lambda a: a.update({name: a[name].to(dtype)})


# (id, mutation of fp8_args, exception, argument named, decided in Python before the
# devices: raised on CPU tensors too)
CASES = [
    ("q-fp8", retyped("q", torch.float8_e4m3fn), TypeError, "q", True),
    ("v-fp16-k-fp8", lambda a: a.update(v_cache=a["v_cache"].to(torch.float16)), TypeError, "v_cache", True),
    ("k-fp16-v-fp8", lambda a: a.update(k_cache=a["k_cache"].to(torch.float16)), TypeError, "v_cache", True),
    ("mixed-formats", retyped("v_cache", torch.float8_e5m2), TypeError, "v_cache", True),
    ("k-float32", lambda a: [retyped(n, torch.float32)(a) for n in ("k_cache", "v_cache")], TypeError, "k_cache",
     True),
    ("k-bf16-q-fp16", lambda a: [retyped(n, torch.bfloat16)(a) for n in ("k_cache", "v_cache")], TypeError,
     "k_cache", True),
    ("out-fp8", lambda a: a.update(out=torch.empty_like(a["q"]).to(torch.float8_e4m3fn)), TypeError, "out", True),
    ("new-k-fp8", lambda a: a.update(k=a["k_cache"][:, :1].clone(), v=a["v_cache"][:, :1].clone()), TypeError, "k",
     True),
    ("k_descale-str", replace(k_descale="0.5"), TypeError, "k_descale", True),
    ("v_descale-bool", replace(v_descale=True), TypeError, "v_descale", True),
    ("k_descale-list", replace(k_descale=[0.5]), TypeError, "k_descale", True),
    ("k_descale-zero", replace(k_descale=0.0), ValueError, "k_descale", True),  # 0 is 1 to the core
    ("v_descale-int-zero", replace(v_descale=0), ValueError, "v_descale", True),
    ("k_descale-fp16-tensor", replace(k_descale=torch.ones(1, dtype=torch.float16), v_descale=torch.ones(1)),
     TypeError, "k_descale", True),
    ("v_descale-float64-tensor", replace(k_descale=torch.ones(1), v_descale=torch.ones(1, dtype=torch.float64)),
     TypeError, "v_descale", True),
    ("k_descale-per-head", replace(k_descale=torch.ones(HKV), v_descale=torch.ones(HKV)), ValueError, "k_descale",
     True),
    ("v_descale-per-q-head", replace(k_descale=torch.ones(B, HKV), v_descale=torch.ones(B, HQ)), ValueError,
     "v_descale", True),
    ("k_descale-empty", replace(k_descale=torch.ones(0), v_descale=torch.ones(0)), ValueError, "k_descale", True),
    ("v_descale-missing", replace(k_descale=torch.ones(1)), ValueError, "v_descale", True),
    ("k_descale-float-with-tensor", replace(k_descale=0.5, v_descale=torch.ones(1)), ValueError, "k_descale", True),
    # After the devices (q's device error first on CPU tensors):
    ("k_descale-on-cpu", lambda a: a.update(k_descale=torch.ones(1), v_descale=torch.ones(1, device=a["q"].device)),
     ValueError, "k_descale", False),
    # Decided by the Go core:
    ("k_descale-fp16-cache", lambda a: [a.update({n: a[n].to(a["q"].dtype)}) for n in ("k_cache", "v_cache")]
     + [a.update(k_descale=0.5)], ValueError, "k_descale", False),
    ("v_descale-tensors-fp16-cache", lambda a: [a.update({n: a[n].to(a["q"].dtype)}) for n in ("k_cache", "v_cache")]
     + [a.update(k_descale=torch.ones(1, device=a["q"].device), v_descale=torch.ones(1, device=a["q"].device))],
     ValueError, "k_descale", False),
    ("k_descale-negative", replace(k_descale=-0.5), ValueError, "k_descale", False),
    ("v_descale-nan", replace(v_descale=math.nan), ValueError, "v_descale", False),
    ("v_descale-inf", replace(v_descale=math.inf), ValueError, "v_descale", False),
    ("k_descale-subnormal", replace(k_descale=1e-40), ValueError, "k_descale", False),
    ("k_descale-past-float32", replace(k_descale=1e39), ValueError, "k_descale", False),
    ("fp8-row-stride-8-bytes", lambda a: [a.update({n: torch.zeros(B, L, HKV, D + 8, dtype=torch.uint8,
                                                                   device=a[n].device).view(a[n].dtype)[..., :D]})
                                          for n in ("k_cache", "v_cache")], NotImplementedError, "k_cache", False),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("case_id, mutate, exc, name, python", CASES, ids=IDS)
def test_bad_input_cpu(case_id, mutate, exc, name, python):
    if not python:
        exc, name = ValueError, "q"  # on CPU tensors the first device error is q's
    check_refused("cpu", mutate, exc, name, fp8_args)


@pytest.mark.cuda
@pytest.mark.parametrize("case_id, mutate, exc, name, python", CASES, ids=IDS)
def test_bad_input_cuda(case_id, mutate, exc, name, python):
    check_refused("cuda", mutate, exc, name, fp8_args)  # nothing written
    call(fp8_args("cuda"))  # the library keeps working
    check_refused("cuda", mutate, exc, name, fp8_args)  # and refuses it again once a good layout is cached


# ---- plan() of fp8 layouts, and what the core refuses, through the real binding ----

@needs_extension
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_plan_of_an_fp8_cache(fp8):
    p16 = flash_decode.plan(4, 1, 32, 8, 128, 32768, device=-1)
    p8 = flash_decode.plan(4, 1, 32, 8, 128, 32768, device=-1, kv_dtype=fp8)
    assert "fp8" in p8["kernel"] and "fp8" not in p16["kernel"], (p8["kernel"], p16["kernel"])
    assert p8["variant"]["dtype"] == "float16" and p8["num_splits"] >= 1
    paged = flash_decode.plan(4, 1, 32, 8, 128, 32768, device=-1, kv_dtype=fp8, page_size=16, serving=True,
                              k_descale=torch.ones(4, 8), v_descale=torch.ones(4, 8))
    assert "fp8" in paged["kernel"] and "paged" in paged["kernel"]
    assert flash_decode.plan(4, 1, 32, 8, 128, 32768, device=-1, kv_dtype=torch.float16)["kernel"] == p16["kernel"]


def test_plan_refusals_in_python():
    for kwargs, exc, name in [(dict(kv_dtype=torch.float32), TypeError, "kv_dtype"),
                              (dict(kv_dtype=torch.bfloat16), TypeError, "kv_dtype"),
                              (dict(kv_dtype=torch.float8_e4m3fn, k_descale="1"), TypeError, "k_descale"),
                              (dict(kv_dtype=torch.float8_e4m3fn, k_descale=torch.ones(1)), ValueError, "v_descale")]:
        with pytest.raises(exc) as info:
            flash_decode.plan(4, 1, 32, 8, 128, 4096, device=-1, **kwargs)
        assert_names(info.value, exc, name)


@needs_extension
@pytest.mark.parametrize("kwargs, name", [
    (dict(k_descale=0.5), "k_descale"),                               # a float16 cache
    (dict(kv_dtype=torch.float8_e5m2, v_descale=-1.0), "v_descale"),
    (dict(kv_dtype=torch.float8_e5m2, k_descale=math.inf), "k_descale"),
    (dict(kv_dtype=torch.float8_e4m3fn, k_descale=torch.ones(4, 8), v_descale=torch.ones(8, 4).t()), None),
], ids=["fp16-cache", "negative", "inf", "tensors"])
def test_plan_descales_checked_by_the_core(kwargs, name):
    if name is None:
        assert flash_decode.plan(4, 1, 32, 8, 128, 4096, device=-1, **kwargs)["num_splits"] >= 1
        return
    with pytest.raises(ValueError) as info:
        flash_decode.plan(4, 1, 32, 8, 128, 4096, device=-1, **kwargs)
    assert_names(info.value, ValueError, name)


_BINDING_PROBE = """
import json, sys
sys.path.insert(0, {tests!r})
import torch
from flash_decode import _api, _native
import test_fp8 as t

native = _native.binding()
report = {{}}
base = dict(num_splits=0, softmax_scale=None, rotary_interleaved=True, out=None, window_size=(-1, -1), softcap=0.0,
            causal=False, cache_batch_idx=None, cache_leftpad=None, block_table=None, k=None, v=None, rotary_cos=None,
            rotary_sin=None, alibi_slopes=None)
for name, extra in [("e4m3", {{}}), ("e5m2_values", dict(k_descale=0.5, v_descale=3.0)),
                    ("tensors", dict(k_descale=torch.ones(1), v_descale=torch.ones(t.B, t.HKV))),
                    ("fp16_value", dict(k_descale=0.5)), ("negative", dict(v_descale=-2.0))]:
    a = t.fp8_args(fp8=torch.float8_e5m2 if name == "e5m2_values" else torch.float8_e4m3fn)
    if name == "fp16_value":
        a.update(k_cache=a["k_cache"].half(), v_cache=a["v_cache"].half())
    try:
        report[name] = _api._prepare_on(*_api._call(**dict(base, **a, **extra)), -1)
    except Exception as err:
        report[name] = [type(err).__name__, str(err)]
print(json.dumps(report))
"""


@pytest.mark.skipif(not (FAKECUDA / "libcuda.so.1").exists(), reason=f"no stand-in driver at {FAKECUDA}")
@needs_extension
def test_fp8_layouts_accepted_by_the_binding():
    """The fp8 layouts the torch layer builds, as the real Go binding reads them: taken,
    and the core's refusals named (a descale of a float16 cache, a negative one)."""
    import json
    child = run_python(_BINDING_PROBE.format(tests=str(ROOT / "tests")), LD_LIBRARY_PATH=str(FAKECUDA),
                       FLASH_DECODE_FORCE_NATIVE="1")
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    for name in ("e4m3", "e5m2_values", "tensors"):
        assert isinstance(report[name], int) and report[name] > 0, report[name]
    assert len({report["e4m3"], report["e5m2_values"], report["tensors"]}) == 3
    for name, arg in (("fp16_value", "k_descale"), ("negative", "v_descale")):
        kind, text = report[name]
        assert kind == "ValueError" and f": {arg}: invalid argument" in text, text


# ---- torch.compile: the ops carry a descale as a tensor or a value ----

RECORDED = []


def _recording_decode(q, k_cache, v_cache, cache_seqlens, seqlen, cache_batch_idx, cache_leftpad, block_table,
                      softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, num_splits,
                      max_seqlen_k=None, batch_invariant=False, k_descale=None, v_descale=None, k_descale_value=None,
                      v_descale_value=None):
    """A CPU kernel for flash_decode::decode that records its descale arguments."""
    RECORDED.append((k_descale, v_descale, k_descale_value, v_descale_value))
    b, sq, hq, _ = q.shape
    return torch.zeros_like(q), torch.zeros(b, hq, sq)


@pytest.fixture
def recording_ops():
    with cpu_kernels({"decode": _recording_decode}):
        RECORDED.clear()
        yield RECORDED


def test_op_schemas_take_descales():
    for op in (torch.ops.flash_decode.decode, torch.ops.flash_decode.decode_append):
        names = [a.name for a in op.default._schema.arguments]
        assert names[-7:-2] == ["k_descale", "v_descale", "k_descale_value", "v_descale_value", "sinks"], names


def test_compiled_fp8_step_passes_descales(recording_ops):
    a = fp8_args()
    kd = torch.rand(B, HKV)

    def step(q, k_cache, v_cache, lens, kd):
        out, lse = flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens, k_descale=kd, v_descale=kd * 2,
                                             return_softmax_lse=True)
        return out * 1, lse

    def step_float(q, k_cache, v_cache, lens):
        return flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens, k_descale=0.5, v_descale=None) * 1

    args = (a["q"], a["k_cache"], a["v_cache"], a["cache_seqlens"])
    explanation = torch._dynamo.explain(step)(*args, kd)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.compile(step, fullgraph=True, backend="aot_eager")(*args, kd)
    kd_got, vd_got, kv_got, vv_got = recording_ops[-1]
    assert torch.equal(kd_got, kd) and torch.equal(vd_got, kd * 2) and kv_got is None and vv_got is None
    torch.compile(step_float, fullgraph=True, backend="aot_eager")(*args)
    assert recording_ops[-1] == (None, None, 0.5, None)


def test_compiled_fp8_call_checks_descales_at_trace_time(recording_ops):
    a = fp8_args()

    def step(q, k_cache, v_cache, lens):
        return flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens, k_descale=torch.ones(2),
                                         v_descale=torch.ones(2))

    pattern = r"k_descale: invalid argument: must have 1 element or shape \(batch, nheads_kv\)"
    with pytest.raises(Exception, match=pattern) as raised:
        torch.compile(step, fullgraph=True, backend="aot_eager")(a["q"], a["k_cache"], a["v_cache"],
                                                                 a["cache_seqlens"])
    # fullgraph wraps the error in dynamo's own, which shows it as raised.
    assert isinstance(raised.value, ValueError) or "ValueError(" in str(raised.value), raised.value
    assert recording_ops == []


# ---- on the GPU: against the fp32 reference on the dequantized cache ----

def descales(form, batch, heads_kv, scale, device, g):
    """(the argument, its (batch, heads_kv) fp32 values) for a descale form: None (1), a float,
    a 1-element tensor or a (batch, heads_kv) one."""
    if form == "none":
        return None, torch.ones(batch, heads_kv, device=device)
    if form == "float":
        return scale, torch.full((batch, heads_kv), scale, device=device)
    if form == "one":
        t = torch.tensor([scale], device=device)
        return t, t.expand(batch, heads_kv)
    t = (scale * (0.5 + torch.rand(batch, heads_kv, generator=g))).to(device)
    return t, t


def per_sequence(cache, rows):
    """The (batch, seqlen, heads_kv, headdim) rows of a contiguous cache the sequences read."""
    return cache if rows is None else cache[rows.long()]


def dequantized(c8, d):
    """An fp8 cache's values as attended, fp32: c8 * descale of (sequence, K/V head)."""
    return c8.float() * d.view(d.shape[0], 1, d.shape[1], 1)


def check_against_fp16(q, out8, lse8, k_deq, v_deq, kwargs):
    """out8 and lse8 (None: not returned) against the fp32 reference on the dequantized caches
    (dense, one row a sequence): within bound_errors' bounds, and at most 3x the error of
    flash_decode on those caches in q's dtype (FA's rule)."""
    ref_out, ref_lse, _, _ = reference_kvcache(q, k_deq, v_deq, **kwargs)
    out16, lse16 = flash_decode.flash_decode(q, k_deq.to(q.dtype), v_deq.to(q.dtype), return_softmax_lse=True,
                                             **kwargs)
    errors = bound_errors(out8, lse8, ref_out, ref_lse, q.dtype)
    assert not errors, errors
    err8 = (out8.float() - ref_out).abs().max().item()
    err16 = (out16.float() - ref_out).abs().max().item()
    assert err8 <= 3 * err16 + 1e-5, (err8, err16)
    if lse8 is not None:
        seen = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse8), seen)
        if seen.any():
            e8 = (lse8 - ref_lse)[seen].abs().max().item()
            e16 = (lse16 - ref_lse)[seen].abs().max().item()
            assert e8 <= 3 * e16 + 1e-5 * (1 + ref_lse[seen].abs().max().item()), (e8, e16)


# (id, batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache, extra arguments;
# "page": a paged cache of that page size, shuffled; "rows": cache_batch_idx over more rows)
SHAPES = [
    ("gqa-d128", 2, 1, 32, 8, 128, 1000, {}),
    ("mqa-d64", 3, 1, 8, 1, 64, 700, {}),
    ("mha-d256", 2, 1, 4, 4, 256, 300, {}),
    ("sq4-causal", 2, 4, 16, 4, 128, 513, dict(causal=True)),
    ("sq16-causal-mqa", 1, 16, 4, 1, 128, 2048, dict(causal=True)),
    ("padded-d96", 2, 1, 8, 2, 96, 257, {}),
    ("paged16", 3, 2, 8, 2, 128, 640, dict(page=16, causal=True)),
    ("paged1", 2, 1, 8, 2, 64, 100, dict(page=1)),
    ("window", 2, 3, 8, 2, 128, 900, dict(window_size=(100, 0))),
    ("softcap", 2, 1, 8, 2, 128, 400, dict(softcap=5.0, softmax_scale=0.3)),
    ("alibi", 2, 2, 8, 2, 64, 300, dict(alibi=True, causal=True)),
    ("leftpad", 2, 1, 8, 2, 128, 300, dict(leftpad=True)),
    ("cache_batch_idx", 2, 1, 8, 2, 128, 300, dict(rows=4)),
    ("splits-1", 1, 1, 8, 1, 128, 8192, dict(num_splits=1)),
    ("splits-many", 1, 1, 8, 1, 128, 8192, dict(num_splits=37)),
]


def gpu_case(shape, fp8, dtype, form, seed=0):
    """A call's arguments on the GPU (the caches fp8) and, for the reference, the dense
    dequantized caches (one row a sequence) and the reference's arguments."""
    _, batch, sq, hq, hkv, d, length, extra = shape
    g = torch.Generator().manual_seed(seed)
    extra = dict(extra)
    rows, page = extra.pop("rows", None), extra.pop("page", None)
    alibi, leftpad = extra.pop("alibi", False), extra.pop("leftpad", False)
    kd_arg, kd = descales(form, batch, hkv, 0.02, "cuda", g)
    vd_arg, vd = descales(form, batch, hkv, 0.03, "cuda", g)
    n_rows = rows or batch
    # Stored as x / nominal scale, so that the values attended are about x's size.
    kn, vn = (1.0, 1.0) if form == "none" else (0.02, 0.03)
    k8 = quantize(torch.randn(n_rows, length, hkv, d, generator=g).cuda(), kn, fp8)
    v8 = quantize(torch.randn(n_rows, length, hkv, d, generator=g).cuda(), vn, fp8)
    q = torch.randn(batch, sq, hq, d, generator=g).to("cuda", dtype)
    lens = torch.randint(1, length + 1, (batch,), generator=g, dtype=torch.int32).cuda()
    lens[0] = length
    kwargs = dict(cache_seqlens=lens, **extra)
    if alibi:
        kwargs["alibi_slopes"] = torch.rand(hq, generator=g).cuda() * 0.1
    if leftpad:
        kwargs["cache_leftpad"] = torch.minimum(torch.tensor([0, 5], dtype=torch.int32).cuda()[:batch], lens)
    idx = None
    if rows:
        idx = torch.randperm(rows, generator=g)[:batch].to(torch.int32).cuda()
    k_deq = dequantized(per_sequence(k8, idx), kd)
    v_deq = dequantized(per_sequence(v8, idx), vd)
    call_args = dict(q=q, k_cache=k8, v_cache=v8, k_descale=kd_arg, v_descale=vd_arg, **kwargs)
    if idx is not None:
        call_args["cache_batch_idx"] = idx
    if page:
        k_pages, v_pages, table = make_paged(k8.view(torch.uint8), v8.view(torch.uint8), page, generator=g, fill=0x7F)
        call_args.update(k_cache=k_pages.view(fp8), v_cache=v_pages.view(fp8), block_table=table)
    return call_args, k_deq, v_deq, kwargs


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["none", "float", "one", "per-head"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_fp8_matches_the_dequantized_reference(shape, fp8, dtype, form):
    call_args, k_deq, v_deq, kwargs = gpu_case(shape, fp8, dtype, form)
    q = call_args["q"]
    out, lse = call(dict(call_args, return_softmax_lse=True))
    assert out.dtype == dtype and out.shape == q.shape
    check_against_fp16(q, out, lse, k_deq, v_deq, kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_fp8_out_and_int_lengths(fp8):
    call_args, k_deq, v_deq, kwargs = gpu_case(SHAPES[0], fp8, torch.float16, "per-head")
    q = call_args["q"]
    out = torch.empty_like(q)
    got = call(dict(call_args, out=out, cache_seqlens=700))
    assert got is out
    check_against_fp16(q, out, None, k_deq, v_deq, dict(kwargs, cache_seqlens=700))
    lens = kwargs["cache_seqlens"]
    got = call(dict(call_args, max_seqlen_k=int(lens.max())))
    check_against_fp16(q, got, None, k_deq, v_deq, kwargs)


def appended(c8, new, positions, d, fp8, rows=None, table=None):
    """c8 (a copy) with the new tokens (batch, seqlen_new, heads_kv, headdim), in q's dtype,
    written at positions (batch,) + t as torch quantizes them by d (batch, heads_kv)."""
    c8 = c8.view(torch.uint8).clone()
    q8 = quantize(new, d.view(d.shape[0], 1, d.shape[1], 1), fp8).view(torch.uint8)
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            p = int(positions[b]) + t
            if table is not None:
                c8[int(table[b, p // c8.shape[1]]), p % c8.shape[1]] = q8[b, t]
            else:
                c8[b if rows is None else int(rows[b]), p] = q8[b, t]
    return c8.view(fp8)


@pytest.mark.cuda
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("page", [None, 16, 1], ids=["contiguous", "paged16", "paged1"])
@pytest.mark.parametrize("form", ["float", "per-head"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_fp8_append_is_torchs_quantization(fp8, dtype, form, page, rotary):
    """The appended tokens in the cache equal torch's quantization of them (after rotary,
    in fp32, rounded to q's dtype) bit for bit; every other byte stays; the output is
    attention over the cache as it then is."""
    batch, seqlen_new, hq, hkv, d, length = 2, 3, 8, 2, 128, 96
    g = torch.Generator().manual_seed(5)
    kd_arg, kd = descales(form, batch, hkv, 0.02, "cuda", g)
    vd_arg, vd = descales(form, batch, hkv, 0.03, "cuda", g)
    k8 = quantize(torch.randn(batch, length, hkv, d, generator=g).cuda(), 0.02, fp8)
    v8 = quantize(torch.randn(batch, length, hkv, d, generator=g).cuda(), 0.03, fp8)
    q = torch.randn(batch, seqlen_new, hq, d, generator=g).to("cuda", dtype)
    k = (torch.randn(batch, seqlen_new, hkv, d, generator=g) * 20).to("cuda", dtype)  # some past the range
    v = torch.randn(batch, seqlen_new, hkv, d, generator=g).to("cuda", dtype)
    lens = torch.tensor([40, 93], dtype=torch.int32, device="cuda")
    args = dict(k=k, v=v, cache_seqlens=lens, causal=True, k_descale=kd_arg, v_descale=vd_arg)
    if rotary:
        cos, sin = rotary_tables(length, 64, dtype=dtype, device="cuda")
        args.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary == "interleaved")
    k_cache, v_cache, table = k8.clone(), v8.clone(), None
    if page:
        k_pages, v_pages, table = make_paged(k8.view(torch.uint8), v8.view(torch.uint8), page, generator=g, fill=0)
        k_cache, v_cache = k_pages.view(fp8), v_pages.view(fp8)
        args["block_table"] = table
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = flash_decode.flash_decode(q, k_cache, v_cache, return_softmax_lse=True, **args)

    positions = lens.long()
    k_rot, q_rot = k, q
    if rotary:
        new_pos = positions.view(-1, 1) + torch.arange(seqlen_new, device="cuda")
        k_rot = apply_rotary(k, cos, sin, new_pos.cpu(), rotary == "interleaved").to(dtype)
        q_rot = apply_rotary(q, cos, sin, new_pos.cpu(), rotary == "interleaved").to(dtype)  # causal: rows at L + i
    want_k = appended(k_before, k_rot, positions, kd, fp8, table=table)
    want_v = appended(v_before, v, positions, vd, fp8, table=table)
    assert same_bits(k_cache, want_k), "k_cache after the append differs from torch's quantization"
    assert same_bits(v_cache, want_v), "v_cache after the append differs from torch's quantization"

    dense_k, dense_v = appended(k8, k_rot, positions, kd, fp8), appended(v8, v, positions, vd, fp8)
    check_against_fp16(q_rot, out, lse, dequantized(dense_k, kd), dequantized(dense_v, vd),
                       dict(cache_seqlens=lens + seqlen_new, causal=True))


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", FP8, ids=FP8_IDS)
def test_fp8_cuda_graph_replay(fp8):
    """A paged fp8 append step with descale tensors captured once, replayed with new
    lengths, new tokens and new descales written into the captured tensors."""
    batch, hq, hkv, d, length, page = 2, 8, 2, 128, 256, 16
    g = torch.Generator().manual_seed(7)
    k8 = quantize(torch.randn(batch, length, hkv, d, generator=g).cuda(), 0.02, fp8)
    v8 = quantize(torch.randn(batch, length, hkv, d, generator=g).cuda(), 0.02, fp8)
    k_pages, v_pages, table = make_paged(k8.view(torch.uint8), v8.view(torch.uint8), page, generator=g, fill=0)
    k_pages, v_pages = k_pages.view(fp8), v_pages.view(fp8)
    q = torch.randn(batch, 1, hq, d, generator=g).to("cuda", torch.float16)
    k_new = torch.zeros(batch, 1, hkv, d, dtype=torch.float16, device="cuda")
    v_new = torch.zeros_like(k_new)
    lens = torch.tensor([10, 20], dtype=torch.int32, device="cuda")
    kd = torch.full((batch, hkv), 0.02, device="cuda")
    vd = torch.full((batch, hkv), 0.02, device="cuda")

    def step(k_cache, v_cache):
        return flash_decode.flash_decode(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, block_table=table,
                                         causal=True, k_descale=kd, v_descale=vd, return_softmax_lse=True)

    k_g, v_g = k_pages.clone(), v_pages.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(k_pages.clone(), v_pages.clone())  # warm up: prepares the layout
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step(k_g, v_g)
    k_e, v_e = k_pages.clone(), v_pages.clone()
    for s in range(3):
        lens.copy_(torch.tensor([10 + s, 20 + 2 * s], dtype=torch.int32))
        k_new.copy_(torch.randn(batch, 1, hkv, d, generator=g).half())
        v_new.copy_(torch.randn(batch, 1, hkv, d, generator=g).half())
        kd.copy_(0.01 + torch.rand(batch, hkv, generator=g) * 0.02)
        graph.replay()
        want_out, want_lse = step(k_e, v_e)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(lse, want_lse)
        assert same_bits(k_g, k_e) and same_bits(v_g, v_e)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_fp8_compiled_step_matches_eager(backend):
    torch._dynamo.reset()
    call_args, _, _, _ = gpu_case(SHAPES[6], torch.float8_e4m3fn, torch.bfloat16, "per-head")  # paged 16
    kd, vd = call_args.pop("k_descale"), call_args.pop("v_descale")

    def step(q, k_cache, v_cache, kd, vd, lens, table):
        out, lse = flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, causal=True,
                                             k_descale=kd, v_descale=vd, return_softmax_lse=True)
        return out * 1, lse

    def step_float(q, k_cache, v_cache, lens, table):
        return flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                         k_descale=0.02, v_descale=0.03) * 1

    args = (call_args["q"], call_args["k_cache"], call_args["v_cache"])
    rest = (call_args["cache_seqlens"], call_args["block_table"])
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for got, want in zip(compiled(*args, kd, vd, *rest), step(*args, kd, vd, *rest)):
        torch.testing.assert_close(got, want)
    compiled = torch.compile(step_float, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(*args, *rest), step_float(*args, *rest))
