"""Bad input raises TypeError / ValueError / NotImplementedError whose message
starts with the argument's name, and the library keeps working afterwards.

Argument checks run before any device check, so every case but the ones about
devices also runs on a machine without a GPU (CPU tensors).
"""

import re

import pytest
import torch

import flash_decode
from conftest import assert_matches_reference

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


# (id, mutation of valid_args, exception class, argument name, runs on CPU tensors)
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
     ValueError, "nheads_q", True),
    ("headdim-100", lambda a: [shaped(n, *a[n].shape[:3], 100)(a) for n in ("q", "k_cache", "v_cache")],
     NotImplementedError, "headdim", True),
    ("headdim-264", lambda a: [shaped(n, *a[n].shape[:3], 264)(a) for n in ("q", "k_cache", "v_cache")],
     NotImplementedError, "headdim", True),
    ("seqlen_q-17", shaped("q", B, 17, HQ, D), NotImplementedError, "seqlen_q", True),
    ("seqlen_q-0", shaped("q", B, 0, HQ, D), ValueError, "seqlen_q", True),
    ("batch-0", lambda a: [shaped(n, 0, *a[n].shape[1:])(a) for n in ("q", "k_cache", "v_cache")]
     + [setting(cache_seqlens=None)(a)], ValueError, "batch", True),
    ("seqlen_cache-0", lambda a: [shaped(n, B, 0, HKV, D)(a) for n in ("k_cache", "v_cache")]
     + [setting(cache_seqlens=None)(a)], ValueError, "seqlen_cache", True),
    ("q-last-dim-strided", lambda a: a.update(q=strided_last(a["q"])), ValueError, "q", True),
    ("k-last-dim-strided", lambda a: a.update(k_cache=strided_last(a["k_cache"])), ValueError, "k_cache", True),
    ("v-last-dim-strided", lambda a: a.update(v_cache=strided_last(a["v_cache"])), ValueError, "v_cache", True),
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
    ("seqlens-int-negative", setting(cache_seqlens=-1), ValueError, "cache_seqlens", True),
    ("seqlens-int-too-long", setting(cache_seqlens=L + 1), ValueError, "cache_seqlens", True),
    ("num_splits-negative", setting(num_splits=-1), ValueError, "num_splits", True),
    ("num_splits-float", setting(num_splits=2.0), TypeError, "num_splits", True),
    ("num_splits-str", setting(num_splits="4"), TypeError, "num_splits", True),
    ("num_splits-bool", setting(num_splits=True), TypeError, "num_splits", True),
    ("scale-str", setting(softmax_scale="0.1"), TypeError, "softmax_scale", True),
    ("scale-nan", setting(softmax_scale=float("nan")), ValueError, "softmax_scale", True),
    ("scale-inf", setting(softmax_scale=float("inf")), ValueError, "softmax_scale", True),
    ("scale-zero", setting(softmax_scale=0.0), ValueError, "softmax_scale", True),
    ("scale-negative", setting(softmax_scale=-0.1), ValueError, "softmax_scale", True),
    ("out-not-tensor", setting(out=[]), TypeError, "out", True),
    ("out-shape", shaped("out", B, SQ, HQ, D + 8), ValueError, "out", True),
    ("out-transposed-shape", lambda a: a.update(out=torch.empty_like(a["q"]).transpose(1, 2)),
     ValueError, "out", True),
    ("out-dtype", lambda a: a.update(out=torch.empty_like(a["q"], dtype=torch.bfloat16)), TypeError, "out", True),
    ("out-last-dim-strided", lambda a: a.update(out=strided_last(a["q"])), ValueError, "out", True),
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
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    assert re.match(rf"{name}\b", str(info.value)), f"message does not start with {name!r}: {info.value}"


@pytest.mark.parametrize("case_id, mutate, exc, name, cpu_ok", CASES, ids=IDS)
def test_bad_input_cpu(case_id, mutate, exc, name, cpu_ok):
    if not cpu_ok:
        # On CPU tensors the first device error is q's; still an error naming q.
        exc, name = ValueError, "q"
    check_raises("cpu", mutate, exc, name)


def test_cpu_tensors_rejected_before_native_code():
    with pytest.raises(ValueError, match=r"^q must be a CUDA tensor"):
        call(valid_args("cpu"))
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()


def test_headdim_message_names_supported():
    args = valid_args("cpu")
    CASES[IDS.index("headdim-100")][1](args)
    with pytest.raises(NotImplementedError, match="64, 128 and 256"):
        call(args)


@pytest.mark.cuda
@pytest.mark.parametrize("case_id, mutate, exc, name, cpu_ok", CASES, ids=IDS)
def test_bad_input_cuda(case_id, mutate, exc, name, cpu_ok):
    check_raises("cuda", mutate, exc, name)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", ["k_cache", "v_cache", "cache_seqlens"])
def test_other_gpu(name):
    args = valid_args("cuda:0")
    args[name] = args[name].to("cuda:1")
    with pytest.raises(ValueError, match=rf"^{name} must be on q's device"):
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
@pytest.mark.parametrize("case_id, mutate, exc, name, cpu_ok", CASES, ids=IDS)
def test_bad_input_after_good_call(case_id, mutate, exc, name, cpu_ok):
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
