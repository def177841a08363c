"""Bad input raises TypeError / ValueError / NotImplementedError whose message
names the argument, and the library keeps working afterwards.

The torch layer checks what only Python can see (Python types); the Go core
checks the tensors (ranks, dtypes, that they agree in shape, devices) before
q's device, without a GPU, so those cases also run on a machine without one
(CPU tensors, the extension planning on its stand-in driver). Every value limit
comes from the core too, whose message reads "flashdecode: <op>: <argument>:
...": on CPU tensors those cases stop at q's device instead.
"""


import pytest
import torch

import flash_decode
from conftest import assert_matches_reference, assert_names, has_extension
from fakes import layout_binding  # noqa: F401  (a fixture)

B, SQ, HQ, HKV, D, L = 2, 2, 8, 2, 64, 40


def valid_args(device):
    """Arguments of a good call: q, k_cache, v_cache and keyword arguments."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, torch.float16)

    return dict(q=randn(B, SQ, HQ, D), k_cache=randn(B, L, HKV, D), v_cache=randn(B, L, HKV, D),
                cache_seqlens=torch.tensor([L, 7], dtype=torch.int32, device=device))


def call(args):
    args = dict(args)
    return flash_decode.flash_decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


def strided_last(t):
    """t's values in a tensor whose last dimension has stride 2."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def shaped(name, *shape):
    """A mutation replacing args[name] by random data of the given shape."""
    return lambda a: a.update({name: torch.randn(*shape).to(a["q"].device, a["q"].dtype)})


def cast(name, dtype):
    return lambda a: a.update({name: a[name].to(dtype)})


def to_cpu(name):
    return lambda a: a.update({name: a[name].cpu()})


def setting(**kw):
    return lambda a: a.update(kw)


def overlapping_out(name):
    """A mutation making out a view of q's shape into args[name]'s memory."""
    def mutate(a):
        q, t = a["q"], a[name]
        a["out"] = t.view(-1)[:q.numel()].view(q.shape)
    return mutate


# (id, mutation of valid_args, exception class, argument name, decided before q's
# device: raised on CPU tensors too)
CASES = [
    ("q-not-tensor", lambda a: a.update(q=a["q"].tolist()), TypeError, "q", True),
    ("k-not-tensor", lambda a: a.update(k_cache=None), TypeError, "k_cache", True),
    ("v-not-tensor", lambda a: a.update(v_cache=1.0), TypeError, "v_cache", True),
    ("q-rank3", shaped("q", B, HQ, D), ValueError, "q", True),
    ("k-rank5", shaped("k_cache", B, L, HKV, D, 1), ValueError, "k_cache", True),
    ("v-rank3", shaped("v_cache", B, L, HKV * D), ValueError, "v_cache", True),
    ("q-float32", cast("q", torch.float32), TypeError, "q", True),
    ("k-bf16-q-fp16", cast("k_cache", torch.bfloat16), TypeError, "k_cache", True),
    ("v-float32", cast("v_cache", torch.float32), TypeError, "v_cache", True),
    ("k-batch", shaped("k_cache", B + 1, L, HKV, D), ValueError, "k_cache", True),
    ("k-headdim", shaped("k_cache", B, L, HKV, D + 8), ValueError, "k_cache", True),
    ("v-headdim", shaped("v_cache", B, L, HKV, 2 * D), ValueError, "v_cache", True),
    ("v-seqlen", shaped("v_cache", B, L - 1, HKV, D), ValueError, "v_cache", True),
    ("v-heads", shaped("v_cache", B, L, 2 * HKV, D), ValueError, "v_cache", True),
    ("heads-not-multiple", lambda a: [shaped(n, B, L, 3, D)(a) for n in ("k_cache", "v_cache")],
     ValueError, "nheads_q", False),
    ("headdim-100", lambda a: [shaped(n, *a[n].shape[:3], 100)(a) for n in ("q", "k_cache", "v_cache")],
     NotImplementedError, "headdim", False),
    ("headdim-264", lambda a: [shaped(n, *a[n].shape[:3], 264)(a) for n in ("q", "k_cache", "v_cache")],
     NotImplementedError, "headdim", False),
    ("seqlen_q-17", shaped("q", B, 17, HQ, D), NotImplementedError, "seqlen_q", False),
    ("seqlen_q-0", shaped("q", B, 0, HQ, D), ValueError, "seqlen_q", False),
    ("batch-0", lambda a: [shaped(n, 0, *a[n].shape[1:])(a) for n in ("q", "k_cache", "v_cache")]
     + [setting(cache_seqlens=None)(a)], ValueError, "batch", False),
    ("q-last-dim-strided", lambda a: a.update(q=strided_last(a["q"])), ValueError, "q", False),
    ("k-last-dim-strided", lambda a: a.update(k_cache=strided_last(a["k_cache"])), ValueError, "k_cache", False),
    ("v-last-dim-strided", lambda a: a.update(v_cache=strided_last(a["v_cache"])), ValueError, "v_cache", False),
    ("seqlens-int64", cast("cache_seqlens", torch.int64), TypeError, "cache_seqlens", True),
    ("seqlens-float", cast("cache_seqlens", torch.float32), TypeError, "cache_seqlens", True),
    ("seqlens-length", lambda a: a.update(cache_seqlens=a["cache_seqlens"].repeat(2)),
     ValueError, "cache_seqlens", True),
    ("seqlens-2d", lambda a: a.update(cache_seqlens=a["cache_seqlens"].view(B, 1)),
     ValueError, "cache_seqlens", True),
    ("seqlens-strided", lambda a: a.update(cache_seqlens=a["cache_seqlens"].repeat(2)[::2]),
     ValueError, "cache_seqlens", True),
    ("seqlens-list", setting(cache_seqlens=[L, 7]), TypeError, "cache_seqlens", True),
    ("seqlens-bool", setting(cache_seqlens=True), TypeError, "cache_seqlens", True),
    # An int length is checked per call (it is not part of the layout), after the devices.
    ("seqlens-int-negative", setting(cache_seqlens=-1), ValueError, "cache_seqlens", False),
    ("seqlens-int-too-long", setting(cache_seqlens=L + 1), ValueError, "cache_seqlens", False),
    ("num_splits-negative", setting(num_splits=-1), ValueError, "num_splits", False),
    ("num_splits-float", setting(num_splits=2.0), TypeError, "num_splits", True),
    ("num_splits-str", setting(num_splits="4"), TypeError, "num_splits", True),
    ("num_splits-bool", setting(num_splits=True), TypeError, "num_splits", True),
    # Past int64, what the Go core takes: refused by name, not by the binding's conversion.
    ("num_splits-past-int64", setting(num_splits=1 << 63), ValueError, "num_splits", True),
    ("window-past-int64", setting(window_size=(1 << 70, 0)), ValueError, "window_size", True),
    ("seqlens-int-past-int64", setting(cache_seqlens=1 << 63), ValueError, "cache_seqlens", False),
    ("scale-str", setting(softmax_scale="0.1"), TypeError, "softmax_scale", True),
    ("scale-bool", setting(softmax_scale=True), TypeError, "softmax_scale", True),
    ("scale-nan", setting(softmax_scale=float("nan")), ValueError, "softmax_scale", False),
    ("scale-inf", setting(softmax_scale=float("inf")), ValueError, "softmax_scale", False),
    ("scale-zero", setting(softmax_scale=0.0), ValueError, "softmax_scale", True),  # 0 is None to the core
    ("scale-negative", setting(softmax_scale=-0.1), ValueError, "softmax_scale", False),
    # Rounds to 0 in float32 (the core's "default"), or to a subnormal, or past float32.
    ("scale-underflow", setting(softmax_scale=1e-50), ValueError, "softmax_scale", False),
    ("scale-subnormal", setting(softmax_scale=1e-40), ValueError, "softmax_scale", False),
    ("scale-overflow", setting(softmax_scale=1e39), ValueError, "softmax_scale", False),
    ("scale-huge-int", setting(softmax_scale=10 ** 400), ValueError, "softmax_scale", False),
    ("causal-float", setting(causal=1.0), TypeError, "causal", True),
    ("causal-int", setting(causal=1), TypeError, "causal", True),
    ("causal-none", setting(causal=None), TypeError, "causal", True),
    ("out-not-tensor", setting(out=[]), TypeError, "out", True),
    ("out-shape", shaped("out", B, SQ, HQ, D + 8), ValueError, "out", True),
    ("out-transposed-shape", lambda a: a.update(out=torch.empty_like(a["q"]).transpose(1, 2)),
     ValueError, "out", True),
    ("out-dtype", lambda a: a.update(out=torch.empty_like(a["q"], dtype=torch.bfloat16)), TypeError, "out", True),
    ("out-last-dim-strided", lambda a: a.update(out=strided_last(a["q"])), ValueError, "out", False),
    ("out-is-q", lambda a: a.update(out=a["q"]), ValueError, "out", False),
    ("out-in-k-cache", overlapping_out("k_cache"), ValueError, "out", False),
    ("out-in-v-cache", overlapping_out("v_cache"), ValueError, "out", False),
    ("q-on-cpu", to_cpu("q"), ValueError, "q", True),
    ("k-on-cpu", to_cpu("k_cache"), ValueError, "k_cache", False),
    ("v-on-cpu", to_cpu("v_cache"), ValueError, "v_cache", False),
    ("seqlens-on-cpu", to_cpu("cache_seqlens"), ValueError, "cache_seqlens", False),
    ("out-on-cpu", lambda a: a.update(out=torch.empty_like(a["q"], device="cpu")), ValueError, "out", False),
]
IDS = [c[0] for c in CASES]


def check_raises(device, mutate, exc, name):
    args = valid_args(device)
    mutate(args)
    with pytest.raises(exc) as info:
        call(args)
    assert_names(info.value, exc, name)


@pytest.mark.skipif(not has_extension(), reason="needs the built extension")
@pytest.mark.parametrize("case_id, mutate, exc, name, python", CASES, ids=IDS)
def test_bad_input_cpu(case_id, mutate, exc, name, python):
    if not python:
        # On CPU tensors the first device error is q's; still an error naming q.
        exc, name = ValueError, "q"
    check_raises("cpu", mutate, exc, name)


@pytest.mark.skipif(not has_extension(), reason="needs the built extension")
def test_cpu_tensors_rejected_without_a_gpu():
    with pytest.raises(ValueError, match=r"^flashdecode: prepare: q: invalid argument: must be a CUDA tensor"):
        call(valid_args("cpu"))
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()


@pytest.mark.cuda
@pytest.mark.parametrize("case_id, pattern", [
    ("headdim-100", r"headdim: not supported: 100; supported: multiples of 8 from 8 to 256"),
    ("seqlen_q-17", r"seqlen_q: not supported: 17; supported: 1 to 16"),
    ("heads-not-multiple", r"nheads_q: invalid argument: 8 is not a multiple of nheads_kv=3"),
    ("scale-underflow", r"softmax_scale: invalid argument: 1e-50; must be a positive normal float32"),
    ("k-last-dim-strided", r"k_cache: invalid argument: last dimension has stride 2"),
    ("out-in-k-cache", r"out: invalid argument: bytes .* overlap k_cache's"),
])
def test_message_names_the_limit(case_id, pattern):
    args = valid_args("cuda")
    CASES[IDS.index(case_id)][1](args)
    with pytest.raises(Exception, match=pattern):
        call(args)


# Pairs of option values equal as dict keys (True == 1, 2.0 == 2): after a call
# with the good one, the bad one is still refused.
REPEATS = [("num_splits", 1, True), ("num_splits", 0, False), ("num_splits", 2, 2.0),
           ("softmax_scale", 1.0, True), ("causal", True, 1.0), ("causal", False, 0), ("causal", True, 1)]
REPEAT_IDS = [f"{name}-{good!r}-then-{bad!r}" for name, good, bad in REPEATS]


def check_repeat(device, name, good, bad):
    args = valid_args(device)
    call(dict(args, **{name: good}))
    for _ in range(2):  # the bad value's own signature is never cached either
        with pytest.raises(TypeError) as info:
            call(dict(args, **{name: bad}))
        assert_names(info.value, TypeError, name)


@pytest.mark.parametrize("name, good, bad", REPEATS, ids=REPEAT_IDS)
def test_types_checked_on_repeat_calls(layout_binding, name, good, bad):
    check_repeat("cpu", name, good, bad)


@pytest.mark.cuda
@pytest.mark.parametrize("name, good, bad", REPEATS, ids=REPEAT_IDS)
def test_types_checked_on_repeat_calls_cuda(name, good, bad):
    check_repeat("cuda", name, good, bad)


@pytest.mark.cuda
@pytest.mark.parametrize("case_id, mutate, exc, name, python", CASES, ids=IDS)
def test_bad_input_cuda(case_id, mutate, exc, name, python):
    check_raises("cuda", mutate, exc, name)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", ["k_cache", "v_cache", "cache_seqlens"])
def test_other_gpu(name):
    args = valid_args("cuda:0")
    args[name] = args[name].to("cuda:1")
    with pytest.raises(ValueError, match=rf"^flashdecode: prepare: {name}: invalid argument: must be on q's device"):
        call(args)


@pytest.mark.cuda
def test_works_after_errors():
    for _, mutate, exc, _, _ in CASES:
        args = valid_args("cuda")
        mutate(args)
        with pytest.raises(exc):
            call(args)
    args = valid_args("cuda")
    out, lse = call(dict(args, return_softmax_lse=True))
    assert_matches_reference(out, lse, args["q"], args["k_cache"], args["v_cache"],
                             cache_seqlens=args["cache_seqlens"])


@pytest.mark.cuda
@pytest.mark.parametrize("case_id, mutate, exc, name, python", CASES, ids=IDS)
def test_bad_input_after_good_call(case_id, mutate, exc, name, python):
    # The good call's layout is now cached (later calls skip the Python checks): a bad
    # call must still be caught, with the same message.
    call(valid_args("cuda"))
    check_raises("cuda", mutate, exc, name)


@pytest.mark.cuda
def test_misaligned_address_after_good_call():
    args = valid_args("cuda")
    call(args)
    q = args["q"]
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
    shifted = buf[1:].view(q.shape)  # q's shape and strides (its cached layout), 2 bytes off
    shifted.copy_(q)
    with pytest.raises(NotImplementedError, match=r"\bq\b.*not 16-byte aligned"):
        call(dict(args, q=shifted))
    out, lse = call(dict(args, return_softmax_lse=True))
    assert_matches_reference(out, lse, q, args["k_cache"], args["v_cache"], cache_seqlens=args["cache_seqlens"])
