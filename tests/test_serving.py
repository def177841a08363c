"""flash_decode's serving arguments (flash_attn_with_kvcache's): paged caches,
appended tokens with and without rotary, cache_batch_idx, cache_leftpad,
window, softcap and ALiBi, alone and together, against the fp32 reference
serving_ref.reference_kvcache, outputs and caches after the call; CUDA-graph
replay of an append+paged step; and bad input, which raises naming the
argument and writes nothing.

The CPU tests check what the torch layer decides without a GPU: the
signature, the layout record it sends to the Go binding (a stand-in reads it
back), the checks made before any native call, and that the real binding
takes the layouts.
"""

import inspect
import json

import pytest
import torch

import flash_decode
from conftest import FAKECUDA, LSE_TOL, OUT_TOL, ROOT, assert_names, has_extension, run_python
from fakes import layout_binding  # noqa: F401  (a fixture)
from serving_ref import make_paged, reference_kvcache, rotary_tables

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]


# ---- the signature: flash_attn_with_kvcache's, plus out and max_seqlen_k ----

def test_signature_is_flash_attn_with_kvcache():
    params = inspect.signature(flash_decode.flash_decode).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["q", "k_cache", "v_cache", "k", "v"]
    assert params["k"].default is None and params["v"].default is None
    keywords = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}
    assert list(keywords) == ["rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx", "cache_leftpad",
                              "block_table", "softmax_scale", "causal", "window_size", "softcap",
                              "rotary_interleaved", "alibi_slopes", "num_splits", "return_softmax_lse", "out",
                              "max_seqlen_k", "batch_invariant", "k_descale", "v_descale", "sinks", "cu_seqlens_q",
                              "max_seqlen_q"]
    assert keywords == dict(rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                            num_splits=0, return_softmax_lse=False, out=None, max_seqlen_k=None,
                            batch_invariant=False, k_descale=None, v_descale=None, sinks=None, cu_seqlens_q=None,
                            max_seqlen_q=None)
    doc = flash_decode.flash_decode.__doc__
    for name in keywords:
        assert f"{name}" in doc, name


# ---- what the torch layer sends to the binding (a stand-in, CPU tensors) ----

B, SQ, HQ, HKV, D = 2, 2, 8, 2, 64
PAGE, BLOCKS, NUM_BLOCKS = 16, 3, 8   # 3 blocks of 16 per sequence: 48 keys; 2 blocks spare


def valid_args(device, dtype=torch.float16, paged=True):
    """A good call using every serving argument (cache_batch_idx instead of
    block_table when not paged)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device, dt)

    cos, sin = rotary_tables(64, 32, dtype=dtype, device=device)
    args = dict(q=randn(B, SQ, HQ, D), k=randn(B, 1, HKV, D), v=randn(B, 1, HKV, D),
                rotary_cos=cos, rotary_sin=sin,
                cache_seqlens=torch.tensor([20, 5], dtype=torch.int32, device=device),
                cache_leftpad=torch.tensor([0, 2], dtype=torch.int32, device=device),
                alibi_slopes=torch.rand(HQ, generator=g).to(device), window_size=(16, -1), softcap=20.0,
                causal=True)
    k_dense, v_dense = randn(B, PAGE * BLOCKS, HKV, D), randn(B, PAGE * BLOCKS, HKV, D)
    if paged:
        k_cache, v_cache, block_table = make_paged(k_dense, v_dense, PAGE, generator=g,
                                                   extra_blocks=NUM_BLOCKS - B * BLOCKS)
        args.update(k_cache=k_cache, v_cache=v_cache, block_table=block_table)
    else:
        rows = 4  # cache rows; sequences 0 and 1 use rows 3 and 1
        args.update(k_cache=randn(rows, PAGE * BLOCKS, HKV, D), v_cache=randn(rows, PAGE * BLOCKS, HKV, D),
                    cache_batch_idx=torch.tensor([3, 1], dtype=torch.int32, device=device))
    return args


def call(args):
    args = dict(args)
    return flash_decode.flash_decode(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


def test_layout_sent_to_prepare(layout_binding):
    a = valid_args("cpu")
    out, lse = call(dict(a, return_softmax_lse=True, softmax_scale=0.25, num_splits=3))
    assert out.shape == a["q"].shape and lse.shape == (B, HQ, SQ) and lse.dtype == torch.float32
    ((layout, device),) = layout_binding.args("Prepare")
    kv = HKV * D
    assert device == 0
    assert {name: value for name, value in layout.items() if value not in (0, (0, 0), (0, 0, 0, 0))} == dict(
        dtype=1, batch=B, seqlen_q=SQ, heads_q=HQ, heads_kv=HKV, head_dim=D, seqlen_cache=BLOCKS * PAGE,
        num_splits=3, device_lengths=1, causal=1, scale=0.25,
        q=(SQ * HQ * D, HQ * D, D, 1), k_cache=(PAGE * kv, kv, D, 1), v_cache=(PAGE * kv, kv, D, 1),
        out=(SQ * HQ * D, HQ * D, D, 1),
        page_size=PAGE, num_pages=NUM_BLOCKS, max_pages=BLOCKS, block_table=(BLOCKS, 1), leftpad=1,
        window_left=16, window_right=-1, softcap=20.0, alibi=1, alibi_slopes=(0, 1),
        seqlen_new=1, k_new=(kv, kv, D, 1), v_new=(kv, kv, D, 1),
        rotary_dim=32, rotary_rows=64, rotary_cos=(16, 1), rotary_sin=(16, 1), rotary_interleaved=1)
    assert layout_binding.args("Workspace") == [(1, -1)]
    ((handle, seqlen, *pointers, ws, ws_bytes, stream),) = layout_binding.args("Run")
    assert (handle, seqlen, ws_bytes, stream) == (1, -1, 1000, 0) and ws
    names = ["q", "k_cache", "v_cache", "out", "lse", "cache_seqlens", "block_table", "cache_batch_idx",
             "cache_leftpad", "alibi_slopes", "k", "v", "rotary_cos", "rotary_sin", "k_descale", "v_descale", "sinks",
             "cu_seqlens_q"]
    tensors = dict(a, out=out, lse=lse)
    assert pointers == [tensors[n].data_ptr() if n in tensors else 0 for n in names]


def test_batch_idx_layout_and_per_batch_alibi(layout_binding):
    a = valid_args("cpu", dtype=torch.bfloat16, paged=False)
    a.update(alibi_slopes=torch.rand(B, HQ), rotary_interleaved=False, window_size=[-1, 0], causal=False)
    call(a)
    ((layout, _),) = layout_binding.args("Prepare")
    assert layout["dtype"] == 2 and layout["cache_batch"] == 4 and layout["seqlen_cache"] == BLOCKS * PAGE
    assert layout["page_size"] == 0 and layout["block_table"] == (0, 0)
    assert layout["alibi_slopes"] == (HQ, 1) and layout["rotary_interleaved"] == 0
    assert (layout["window_left"], layout["window_right"]) == (-1, 0) and layout["scale"] == 0.0
    ((_, _, *pointers, _, _, _),) = layout_binding.args("Run")
    assert pointers[6:8] == [0, a["cache_batch_idx"].data_ptr()]


def sizes_of_one(a):
    """valid_args a with a block table and rotary tables whose dimensions of size 1 have
    strides torch allows and the core would refuse on a dimension of more."""
    a["block_table"] = torch.zeros(8, B, dtype=torch.int32).t()[:, 2:3]  # (2, 1), strides (1, 2)
    a["rotary_cos"] = a["rotary_sin"] = torch.zeros(16, dtype=a["q"].dtype).as_strided((1, 16), (3, 1))
    return a


def test_strides_sent_as_torch_gives_them(layout_binding):
    # A dimension of size 1 never moves an address, and the core normalizes its stride
    # (test_layouts_accepted_by_the_binding: it takes these).
    call(sizes_of_one(valid_args("cpu")))
    ((layout, _),) = layout_binding.args("Prepare")
    assert layout["block_table"] == (1, 2) and layout["max_pages"] == 1 and layout["seqlen_cache"] == PAGE
    assert layout["rotary_cos"] == layout["rotary_sin"] == (3, 1) and layout["rotary_rows"] == 1


# Each serving argument on its own, and what it sets in the layout.
SERVING_ALONE = {
    "k_v": (lambda a: dict(k=a["k"], v=a["v"]), dict(seqlen_new=1)),
    "rotary": (lambda a: dict(k=a["k"], v=a["v"], rotary_cos=a["rotary_cos"], rotary_sin=a["rotary_sin"]),
               dict(seqlen_new=1, rotary_dim=32, rotary_interleaved=1)),
    "cache_batch_idx": (lambda a: dict(cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32)), dict(cache_batch=B)),
    "cache_leftpad": (lambda a: dict(cache_leftpad=a["cache_leftpad"]), dict(leftpad=1)),
    "window_size": (lambda a: dict(window_size=(8, 0)), dict(window_left=8, window_right=0)),
    "window_size-list": (lambda a: dict(window_size=[-1, -1]), {}),
    "softcap": (lambda a: dict(softcap=5.0), dict(softcap=5.0)),
    "alibi_slopes": (lambda a: dict(alibi_slopes=a["alibi_slopes"]), dict(alibi=1, alibi_slopes=(0, 1))),
}


@pytest.mark.parametrize("name", list(SERVING_ALONE))
def test_each_serving_argument_reaches_the_layout(layout_binding, name):
    a = valid_args("cpu", paged=False)
    q, k_cache, v_cache = a["q"], a["k_cache"][:B], a["v_cache"][:B]
    arguments, fields = SERVING_ALONE[name]
    for kwargs in ({}, arguments(a)):
        flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=a["cache_seqlens"], **kwargs)
    (plain, _), (layout, _) = layout_binding.args("Prepare")
    assert {n: v for n, v in layout.items() if plain[n] != v and n not in ("k_new", "v_new", "rotary_cos",
                                                                         "rotary_sin", "rotary_rows")} == fields
    assert len(layout_binding.args("Run")) == 2


@pytest.mark.parametrize("defaults", [{}, dict(window_size=(-1, -1), softcap=0.0, k=None, v=None),
                                      dict(softcap=0), dict(rotary_interleaved=False)],
                         ids=["none", "explicit", "int-softcap", "interleaved-alone"])
def test_defaults_are_the_plain_layout(layout_binding, defaults):
    a = valid_args("cpu", paged=False)
    flash_decode.flash_decode(a["q"], a["k_cache"][:B], a["v_cache"][:B], cache_seqlens=5, **defaults)
    ((layout, _),) = layout_binding.args("Prepare")
    assert layout["window_left"] == layout["window_right"] == -1 and layout["softcap"] == 0.0
    assert layout["seqlen_new"] == layout["rotary_dim"] == layout["rotary_interleaved"] == 0
    ((_, _, *pointers, _, _, _),) = layout_binding.args("Run")
    assert pointers[6:] == [0] * 12


def test_serving_layout_prepared_once(layout_binding):
    a = valid_args("cpu")
    for _ in range(3):
        call(a)
    call(dict(a, k=a["k"].clone(), cache_seqlens=a["cache_seqlens"] + 1))  # new tensors, same layout
    assert len(layout_binding.args("Prepare")) == 1 and len(layout_binding.args("Run")) == 4
    call(dict(a, softcap=20))           # equal as a key, another type: its own signature
    call(dict(a, window_size=[16, -1]))
    call(dict(a, rotary_interleaved=False))
    assert len(layout_binding.args("Prepare")) == 4


def test_int_cache_seqlens_with_append(layout_binding):
    a = valid_args("cpu")
    lengths = [10, 11, 10, 30]
    for n in lengths:
        call(dict(a, cache_seqlens=n))
    assert len(layout_binding.args("Prepare")) == 1
    assert layout_binding.args("Workspace") == [(1, 10), (1, 11), (1, 30)]  # when a length needs more
    runs = layout_binding.args("Run")
    assert [r[1] for r in runs] == lengths and all(r[7] == 0 for r in runs)
    assert [r[-2] for r in runs] == [80, 88, 88, 240]  # the workspace's bytes
    with pytest.raises(ValueError, match=r"^cache_seqlens=-1 must not be negative"):
        call(dict(a, cache_seqlens=-1))


_BINDING_PROBE = """
import json, sys
sys.path.insert(0, {tests!r})
import torch
from flash_decode import _native
from records import layout_of, prepare
import test_serving as t

native = _native.binding()
report = {{}}
q = torch.randn(8, 64, 1).permute(2, 0, 1).unsqueeze(0).half()  # (1, 1, 8, 64), contiguous, strides (*, 1, 64, 1)
k = torch.zeros(1, 100, 8, 64, dtype=torch.float16)
for name, args in [("paged", t.valid_args("cpu")), ("batch_idx", t.valid_args("cpu", torch.bfloat16, paged=False)),
                   ("window_only", dict(t.valid_args("cpu", paged=False), k=None, v=None, rotary_cos=None,
                                        rotary_sin=None, alibi_slopes=None, cache_leftpad=None, softcap=0.0)),
                   ("sizes_of_one", t.sizes_of_one(t.valid_args("cpu"))), ("size_one_q", dict(q=q, k_cache=k, v_cache=k)),
                   ("seqlen_q_17", dict(t.valid_args("cpu"), q=torch.zeros(t.B, 17, t.HQ, t.D, dtype=torch.half))),
                   ("plain_seqlen_q_17", dict(q=torch.zeros(1, 17, 8, 64, dtype=torch.half), k_cache=k, v_cache=k))]:
    args = dict(dict(num_splits=0, softmax_scale=None, rotary_interleaved=True, out=None, window_size=(-1, -1),
                     softcap=0.0, causal=False), **args)
    for key in ("cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table", "k", "v", "rotary_cos",
                "rotary_sin", "alibi_slopes"):
        args.setdefault(key, None)
    try:
        layout = layout_of(**args)
        report[name] = prepare(native, layout, 0)
    except Exception as err:
        report[name] = [type(err).__name__, str(err)]
    try:
        prepare(native, dict(layout, q=(1, 1, 1, 2)), 0)
    except Exception as err:
        report[name + "_error"] = [type(err).__name__, str(err)]
print(json.dumps(report))
"""


@pytest.mark.skipif(not (FAKECUDA / "libcuda.so.1").exists(), reason=f"no stand-in driver at {FAKECUDA}")
@pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")
def test_layouts_accepted_by_the_binding():
    """The layouts the torch layer builds, as the real Go binding reads them (every
    value valid, sizes of one with any stride), with a stand-in driver; more than 16
    query tokens is prefill's work."""
    child = run_python(_BINDING_PROBE.format(tests=str(ROOT / "tests")), LD_LIBRARY_PATH=str(FAKECUDA),
                       FLASH_DECODE_FORCE_NATIVE="1")
    assert child.returncode == 0, child.stderr
    report = json.loads(child.stdout.splitlines()[-1])
    for name in ("paged", "batch_idx", "window_only", "sizes_of_one", "size_one_q"):
        assert isinstance(report[name], int) and report[name] > 0, report[name]
        kind, text = report[name + "_error"]
        assert kind == "ValueError" and ": q: invalid argument: last dimension has stride 2" in text
    assert len({report["paged"], report["batch_idx"], report["window_only"]}) == 3
    for name in ("seqlen_q_17", "plain_seqlen_q_17"):
        kind, text = report[name]
        assert kind == "NotImplementedError" and ": seqlen_q: not supported: 17; supported: 1 to 16" in text, text


# ---- bad input: the exception names the argument, nothing is written ----

def replace(**kw):
    return lambda a: a.update(kw)


def retyped(name, dtype):
    return lambda a: a.update({name: a[name].to(dtype)})


def reshaped(name, *shape):
    return lambda a: a.update({name: torch.zeros(*shape, dtype=a[name].dtype, device=a[name].device)})


def strided_last(name):
    """args[name]'s values in a tensor whose last dimension has stride 2."""
    def mutate(a):
        t = a[name]
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        a[name] = wide[..., ::2]
    return mutate


def on_cpu(name):
    return lambda a: a.update({name: a[name].cpu()})


def inside(name, cache):
    """args[name]'s values in the first elements of args[cache], which the
    append writes into."""
    def mutate(a):
        t, c = a[name], a[cache]
        view = c.view(-1)[:t.numel()].view(t.shape)
        view.copy_(t)
        a[name] = view
    return mutate


def unpaged(a):
    """Contiguous caches with cache_batch_idx in place of the block table."""
    c = valid_args(a["q"].device, a["q"].dtype, paged=False)
    for name in ("k_cache", "v_cache", "cache_batch_idx"):
        a[name] = c[name]
    del a["block_table"]


def then(*mutations):
    def mutate(a):
        for m in mutations:
            m(a)
    return mutate


# (id, mutation of valid_args, exception, argument named, decided in Python
# before the devices: raised on CPU tensors too)
CASES = [
    ("k-not-tensor", replace(k=[0.0]), TypeError, "k", True),
    ("v-none", replace(v=None), ValueError, "v", True),
    ("k-none", replace(k=None), ValueError, "k", True),
    ("k-rank3", reshaped("k", B, HKV, D), ValueError, "k", True),
    ("k-bf16", retyped("k", torch.bfloat16), TypeError, "k", True),
    ("v-float32", retyped("v", torch.float32), TypeError, "v", True),
    ("k-heads", reshaped("k", B, 1, HKV + 1, D), ValueError, "k", True),
    ("k-batch", reshaped("k", B + 1, 1, HKV, D), ValueError, "k", True),
    ("k-no-tokens", lambda a: a.update(k=a["k"][:, :0], v=a["v"][:, :0]), ValueError, "k", True),
    ("v-seqlen", reshaped("v", B, 2, HKV, D), ValueError, "v", True),
    ("rotary_sin-none", replace(rotary_sin=None), ValueError, "rotary_sin", True),
    ("rotary_cos-none", replace(rotary_cos=None), ValueError, "rotary_cos", True),
    ("rotary_cos-not-tensor", replace(rotary_cos=1.0), TypeError, "rotary_cos", True),
    ("rotary_cos-rank3", reshaped("rotary_cos", 64, 16, 1), ValueError, "rotary_cos", True),
    ("rotary_cos-float32", retyped("rotary_cos", torch.float32), TypeError, "rotary_cos", True),
    ("rotary_sin-bf16", retyped("rotary_sin", torch.bfloat16), TypeError, "rotary_sin", True),
    ("rotary_sin-shape", reshaped("rotary_sin", 64, 8), ValueError, "rotary_sin", True),
    ("rotary_interleaved-int", replace(rotary_interleaved=1), TypeError, "rotary_interleaved", True),
    ("rotary_interleaved-none", replace(rotary_interleaved=None), TypeError, "rotary_interleaved", True),
    ("block_table-list", lambda a: a.update(block_table=a["block_table"].tolist()), TypeError, "block_table", True),
    ("block_table-int64", retyped("block_table", torch.int64), TypeError, "block_table", True),
    ("block_table-1d", lambda a: a.update(block_table=a["block_table"].flatten()), ValueError, "block_table", True),
    ("block_table-batch", reshaped("block_table", B + 1, BLOCKS), ValueError, "block_table", True),
    ("paged-k_cache-rank3", reshaped("k_cache", NUM_BLOCKS, PAGE, HKV * D), ValueError, "k_cache", True),
    ("paged-k_cache-headdim", reshaped("k_cache", NUM_BLOCKS, PAGE, HKV, 2 * D), ValueError, "k_cache", True),
    ("paged-v_cache-pages", reshaped("v_cache", NUM_BLOCKS + 1, PAGE, HKV, D), ValueError, "v_cache", True),
    ("paged-v_cache-dtype", retyped("v_cache", torch.bfloat16), TypeError, "v_cache", True),
    ("cache_batch_idx-int64", then(unpaged, retyped("cache_batch_idx", torch.int64)), TypeError,
     "cache_batch_idx", True),
    ("cache_batch_idx-shape", then(unpaged, reshaped("cache_batch_idx", B, 1)), ValueError, "cache_batch_idx", True),
    ("k_cache-rows-without-cache_batch_idx", then(unpaged, replace(cache_batch_idx=None)), ValueError,
     "k_cache", True),
    ("cache_leftpad-list", replace(cache_leftpad=[0, 2]), TypeError, "cache_leftpad", True),
    ("cache_leftpad-int64", retyped("cache_leftpad", torch.int64), TypeError, "cache_leftpad", True),
    ("cache_leftpad-shape", reshaped("cache_leftpad", B + 1), ValueError, "cache_leftpad", True),
    ("cache_leftpad-strided", lambda a: a.update(cache_leftpad=a["cache_leftpad"].repeat(2)[::2]),
     ValueError, "cache_leftpad", True),
    ("alibi_slopes-not-tensor", replace(alibi_slopes=0.5), TypeError, "alibi_slopes", True),
    ("alibi_slopes-fp16", retyped("alibi_slopes", torch.float16), TypeError, "alibi_slopes", True),
    ("alibi_slopes-shape", reshaped("alibi_slopes", HQ + 1), ValueError, "alibi_slopes", True),
    ("alibi_slopes-kv-heads", reshaped("alibi_slopes", B, HKV), ValueError, "alibi_slopes", True),
    ("window_size-int", replace(window_size=16), TypeError, "window_size", True),
    ("window_size-3", replace(window_size=(16, -1, 0)), ValueError, "window_size", True),
    ("window_size-float", replace(window_size=(16.0, -1)), TypeError, "window_size", True),
    ("window_size-bool", replace(window_size=(True, -1)), TypeError, "window_size", True),
    ("window_size-none", replace(window_size=None), TypeError, "window_size", True),
    ("softcap-str", replace(softcap="20"), TypeError, "softcap", True),
    ("softcap-bool", replace(softcap=True), TypeError, "softcap", True),
    ("softcap-none", replace(softcap=None), TypeError, "softcap", True),
    ("causal-int", replace(causal=1), TypeError, "causal", True),
    ("num_splits-float", replace(num_splits=2.0), TypeError, "num_splits", True),
    ("out-dtype", lambda a: a.update(out=torch.empty_like(a["q"], dtype=torch.bfloat16)), TypeError, "out", True),
    # After the devices (q's device error first on CPU tensors):
    ("seqlen_q-17", lambda a: a.update(q=torch.zeros(B, 17, HQ, D, dtype=a["q"].dtype, device=a["q"].device)),
     NotImplementedError, "seqlen_q", False),
    ("k-on-cpu", on_cpu("k"), ValueError, "k", False),
    ("v-on-cpu", on_cpu("v"), ValueError, "v", False),
    ("rotary_cos-on-cpu", on_cpu("rotary_cos"), ValueError, "rotary_cos", False),
    ("block_table-on-cpu", on_cpu("block_table"), ValueError, "block_table", False),
    ("cache_leftpad-on-cpu", on_cpu("cache_leftpad"), ValueError, "cache_leftpad", False),
    ("alibi_slopes-on-cpu", on_cpu("alibi_slopes"), ValueError, "alibi_slopes", False),
    ("cache_batch_idx-on-cpu", then(unpaged, on_cpu("cache_batch_idx")), ValueError, "cache_batch_idx", False),
    # Decided by the Go core, which the call reaches only on the GPU:
    ("append-without-cache_seqlens", replace(cache_seqlens=None), ValueError, "cache_seqlens", False),
    ("rotary-without-k-v", replace(k=None, v=None), ValueError, "rotary_cos", False),
    ("cache_batch_idx-with-block_table", replace(cache_batch_idx=torch.zeros(B, dtype=torch.int32)),
     ValueError, "cache_batch_idx", False),
    ("softcap-inf", replace(softcap=float("inf")), ValueError, "softcap", False),
    ("softcap-nan", replace(softcap=float("nan")), ValueError, "softcap", False),
    ("softmax_scale-inf", replace(softmax_scale=float("inf")), ValueError, "softmax_scale", False),
    ("k-last-dim-strided", strided_last("k"), ValueError, "k", False),
    ("v-last-dim-strided", strided_last("v"), ValueError, "v", False),
    ("block_table-strided", strided_last("block_table"), ValueError, "block_table", False),
    ("rotary_cos-strided", strided_last("rotary_cos"), ValueError, "rotary_cos", False),
    ("alibi_slopes-strided", strided_last("alibi_slopes"), ValueError, "alibi_slopes", False),
    # Decided by the Go core: what the append reads must not lie in the caches it writes.
    ("k-inside-k_cache", inside("k", "k_cache"), ValueError, "k", False),
    ("v-inside-k_cache", inside("v", "k_cache"), ValueError, "v", False),
    ("q-inside-v_cache", inside("q", "v_cache"), ValueError, "q", False),
    ("rotary_sin-inside-v_cache", inside("rotary_sin", "v_cache"), ValueError, "rotary_sin", False),
]
IDS = [c[0] for c in CASES]


def check_refused(device, mutate, exc, name, make_args=valid_args):
    """The call of make_args(device), mutated, raises exc naming name, and the caches hold
    what they held, byte for byte (NaN slots too)."""
    args = make_args(device)
    mutate(args)
    before = [args[n].clone() for n in ("k_cache", "v_cache")]
    with pytest.raises(exc) as info:
        call(args)
    assert_names(info.value, exc, name)
    if device != "cpu":
        torch.cuda.synchronize()
    for cache, saved in zip((args["k_cache"], args["v_cache"]), before):
        assert torch.equal(cache.view(torch.uint8), saved.view(torch.uint8))


@pytest.mark.parametrize("case_id, mutate, exc, name, python", CASES, ids=IDS)
def test_bad_input_cpu(case_id, mutate, exc, name, python):
    if not python:
        exc, name = ValueError, "q"  # on CPU tensors the first device error is q's
    check_refused("cpu", mutate, exc, name)


@pytest.mark.parametrize("case_id, mutate, exc, name, python",
                         [c for c in CASES if c[4]], ids=[c[0] for c in CASES if c[4]])
def test_bad_input_never_reaches_the_binding(layout_binding, case_id, mutate, exc, name, python):
    check_refused("cpu", mutate, exc, name)
    assert layout_binding.calls == []


# ---- on the GPU: against the reference ----

def randn(*shape, dtype=torch.float16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def lengths(*values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def run_and_check(q, k_cache, v_cache, k=None, v=None, tol=1.0, **kwargs):
    """flash_decode on copies of the caches against reference_kvcache: out,
    lse and the caches after the call. Returns (out, lse)."""
    k_run, v_run = k_cache.clone(), v_cache.clone()
    out, lse = flash_decode.flash_decode(q, k_run, v_run, k, v, return_softmax_lse=True, **kwargs)
    for plan_only in ("num_splits", "max_seqlen_k"):
        kwargs.pop(plan_only, None)
    ref_out, ref_lse, ref_k, ref_v = reference_kvcache(q, k_cache, v_cache, k, v, **kwargs)
    dtype = q.dtype
    out_tol = {key: tol * value for key, value in OUT_TOL[dtype].items()}
    lse_tol = {key: tol * value for key, value in LSE_TOL[dtype].items()}
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.float(), ref_out, **out_tol)
    torch.testing.assert_close(lse, ref_lse, **lse_tol)
    # The caches: the new (maybe rotated) tokens written, nothing else touched.
    for got, want in ((k_run, ref_k), (v_run, ref_v)):
        torch.testing.assert_close(got, want, equal_nan=True, **OUT_TOL[dtype])
    return out, lse


def make(batch, seqlen_q, nheads_q, nheads_kv, headdim, capacity, dtype=torch.float16, seqlen_new=0, seed=0):
    """Random q, k_cache, v_cache and (seqlen_new > 0) k, v."""
    q = randn(batch, seqlen_q, nheads_q, headdim, dtype=dtype, seed=seed)
    k_cache = randn(batch, capacity, nheads_kv, headdim, dtype=dtype, seed=seed + 1)
    v_cache = randn(batch, capacity, nheads_kv, headdim, dtype=dtype, seed=seed + 2)
    if not seqlen_new:
        return q, k_cache, v_cache, None, None
    return (q, k_cache, v_cache, randn(batch, seqlen_new, nheads_kv, headdim, dtype=dtype, seed=seed + 3),
            randn(batch, seqlen_new, nheads_kv, headdim, dtype=dtype, seed=seed + 4))


def paged(k_cache, v_cache, page_size, extra_blocks=3, seed=0):
    return make_paged(k_cache, v_cache, page_size, generator=torch.Generator().manual_seed(seed),
                      extra_blocks=extra_blocks)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("page_size", [1, 8, 16, 24, 256])  # 1: the serving kernel; multiples of 8: its paged form
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_paged(dtype, page_size, causal, headdim):
    q, k, v, _, _ = make(4, 3, 16, 4, headdim, 515, dtype)
    k_paged, v_paged, block_table = paged(k, v, page_size)
    out, lse = run_and_check(q, k_paged, v_paged, cache_seqlens=lengths(515, 1, 0, 300), block_table=block_table,
                             causal=causal)
    # The same keys in a dense cache give the same attention.
    dense_out, dense_lse = flash_decode.flash_decode(q, k, v, cache_seqlens=lengths(515, 1, 0, 300), causal=causal,
                                                     return_softmax_lse=True)
    torch.testing.assert_close(out, dense_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, dense_lse, **LSE_TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [1, 3, 40])
def test_paged_num_splits(num_splits):
    q, k, v, _, _ = make(2, 1, 32, 8, 128, 4000)
    k_paged, v_paged, block_table = paged(k, v, 64)
    run_and_check(q, k_paged, v_paged, cache_seqlens=lengths(4000, 1234), block_table=block_table,
                  num_splits=num_splits)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("seqlen_new", [1, 3])
@pytest.mark.parametrize("layout", ["dense", "paged"])
@pytest.mark.parametrize("causal", [False, True])
def test_append(dtype, rotary, seqlen_new, layout, causal):
    q, k_cache, v_cache, k, v = make(3, seqlen_new, 8, 2, 128, 200, dtype, seqlen_new=seqlen_new)
    kwargs = dict(cache_seqlens=lengths(0, 57, 200 - seqlen_new), causal=causal)
    if layout == "paged":
        k_cache, v_cache, kwargs["block_table"] = paged(k_cache, v_cache, 16)
    if rotary:
        kwargs["rotary_cos"], kwargs["rotary_sin"] = rotary_tables(256, 64, dtype=dtype, device="cuda")
        kwargs["rotary_interleaved"] = rotary == "interleaved"
    run_and_check(q, k_cache, v_cache, k, v, **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("headdim,nheads_q,nheads_kv,seqlen_q,causal",
                         [(64, 8, 4, 1, False), (128, 32, 4, 4, True), (256, 8, 2, 2, False)])
@pytest.mark.parametrize("layout", ["dense", "paged8", "paged16"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
def test_appending_forms(rotary, layout, headdim, nheads_q, nheads_kv, seqlen_q, causal, num_splits):
    # The appending forms of stage 1 (the new tokens written by stage 1 itself; with rotary, by
    # the append kernel ahead of it): every head dim, 32 packed rows at head dim 128 (GQA 8, 4
    # query tokens), 16 new tokens across key tiles' boundaries (tiles of 128, 64 and 32 keys),
    # rotary over half the head dim, and splits other than the first holding the new tokens.
    q, k_cache, v_cache, k, v = make(4, seqlen_q, nheads_q, nheads_kv, headdim, 400, seqlen_new=16)
    kwargs = dict(cache_seqlens=lengths(0, 60, 120, 384), causal=causal, num_splits=num_splits)
    if layout != "dense":
        k_cache, v_cache, kwargs["block_table"] = paged(k_cache, v_cache, int(layout[len("paged"):]))
    if rotary:
        kwargs["rotary_cos"], kwargs["rotary_sin"] = rotary_tables(512, headdim // 2, dtype=torch.float16,
                                                                   device="cuda")
        kwargs["rotary_interleaved"] = rotary == "interleaved"
    run_and_check(q, k_cache, v_cache, k, v, **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("bound", [0, 3, 64, 4000, 32768])
@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_append_with_max_seqlen_k(bound, layout):
    # The bound counts the appended tokens too; any bound gives the right answer.
    q, k_cache, v_cache, k, v = make(3, 2, 8, 2, 128, 32768, seqlen_new=2)
    kwargs = dict(cache_seqlens=lengths(0, 57, 1500), causal=True, max_seqlen_k=bound)
    if layout == "paged":
        k_cache, v_cache, kwargs["block_table"] = paged(k_cache, v_cache, 16)
    run_and_check(q, k_cache, v_cache, k, v, **kwargs)


@pytest.mark.cuda
@pytest.mark.parametrize("rotary_dim", [16, 128])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_dims_and_int_lengths(rotary_dim, interleaved):
    q, k_cache, v_cache, k, v = make(2, 4, 16, 4, 128, 300, seqlen_new=2)
    cos, sin = rotary_tables(512, rotary_dim, device="cuda")
    for n in (0, 17, 298):  # an int cache_seqlens, new every step
        run_and_check(q, k_cache, v_cache, k, v, rotary_cos=cos.half(), rotary_sin=sin.half(), cache_seqlens=n,
                      rotary_interleaved=interleaved, causal=n % 2 == 1)


@pytest.mark.cuda
@pytest.mark.parametrize("window_size", [(16, -1), (0, 0), (8, 4), (-1, 2), (300, -1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_window(window_size, causal, seqlen_q):
    q, k, v, _, _ = make(3, seqlen_q, 8, 2, 128, 400)
    run_and_check(q, k, v, cache_seqlens=lengths(400, 3, 150), window_size=window_size, causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("softcap", [5.0, 30.0])
def test_softcap(dtype, softcap):
    q, k, v, _, _ = make(2, 2, 16, 2, 128, 700, dtype)
    q = q * 4  # scores large enough for the cap to matter
    run_and_check(q, k, v, cache_seqlens=lengths(700, 90), softcap=softcap, causal=True, tol=2.0)


@pytest.mark.cuda
@pytest.mark.parametrize("per_sequence", [False, True], ids=["nheads", "batch-nheads"])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi(per_sequence, causal):
    q, k, v, _, _ = make(3, 2, 8, 2, 64, 333)
    g = torch.Generator(device="cuda").manual_seed(5)
    shape = (3, 8) if per_sequence else (8,)
    slopes = torch.rand(shape, generator=g, device="cuda") * 0.5
    run_and_check(q, k, v, cache_seqlens=lengths(333, 20, 1), alibi_slopes=slopes, causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("causal", [False, True])
def test_leftpad(causal):
    q, k, v, _, _ = make(4, 3, 8, 2, 128, 256)
    run_and_check(q, k, v, cache_seqlens=lengths(256, 40, 7, 100), cache_leftpad=lengths(0, 39, 7, 64),
                  causal=causal)


@pytest.mark.cuda
@pytest.mark.parametrize("append", [False, True])
def test_cache_batch_idx(append):
    q, _, _, k, v = make(3, 1, 16, 4, 64, 100, seqlen_new=2 if append else 0)
    k_cache, v_cache = randn(6, 100, 4, 64, seed=7), randn(6, 100, 4, 64, seed=8)  # more cache rows than sequences
    run_and_check(q, k_cache, v_cache, k, v, cache_seqlens=lengths(98, 0, 50), cache_batch_idx=lengths(4, 0, 2))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("combo", ["paged-append-rotary-window-softcap-alibi", "dense-leftpad-append-rotary",
                                   "batch_idx-window-alibi", "paged-leftpad-softcap"])
def test_combinations(dtype, combo):
    q, k_cache, v_cache, k, v = make(3, 2, 16, 4, 128, 320, dtype, seqlen_new=2)
    kwargs = dict(cache_seqlens=lengths(100, 318, 5), causal=True)
    parts = combo.split("-")
    if "append" not in parts:
        k = v = None
    if "paged" in parts:
        k_cache, v_cache, kwargs["block_table"] = paged(k_cache, v_cache, 32)
    if "batch_idx" in parts:
        k_cache, v_cache = randn(5, 320, 4, 128, dtype=dtype, seed=9), randn(5, 320, 4, 128, dtype=dtype, seed=10)
        kwargs["cache_batch_idx"] = lengths(1, 4, 0)
    if "leftpad" in parts:
        kwargs["cache_leftpad"] = lengths(30, 0, 5)
    if "rotary" in parts:
        kwargs["rotary_cos"], kwargs["rotary_sin"] = rotary_tables(400, 128, dtype=dtype, device="cuda")
    if "window" in parts:
        kwargs["window_size"] = (64, -1)
    if "softcap" in parts:
        kwargs["softcap"] = 30.0
    if "alibi" in parts:
        kwargs["alibi_slopes"] = torch.linspace(0.01, 0.3, 16, device="cuda")
    run_and_check(q, k_cache, v_cache, k, v, tol=2.0 if "softcap" in parts else 1.0, **kwargs)


@pytest.mark.cuda
def test_out_of_range_block_ids_are_clamped_on_read():
    q, k, v, _, _ = make(2, 1, 8, 2, 64, 96)
    # Spare blocks of zeros, not NaN: a clamped id may land on one.
    k_paged, v_paged, block_table = make_paged(k, v, 16, generator=torch.Generator().manual_seed(0),
                                               extra_blocks=4, fill=0.0)
    num_blocks = k_paged.shape[0]
    bad = block_table.clone()
    bad[0, 1], bad[1, 0] = -7, num_blocks + 100          # used blocks: read as the clamped ids
    bad[1, 5] = 2 ** 31 - 1                               # past sequence 1's length: never read
    lens = lengths(96, 64)
    out, lse = flash_decode.flash_decode(q, k_paged, v_paged, cache_seqlens=lens, block_table=bad,
                                         return_softmax_lse=True)
    torch.cuda.synchronize()
    clamped = bad.clamp(0, num_blocks - 1)
    clamped[1, 5] = block_table[1, 5]
    ref_out, ref_lse, _, _ = reference_kvcache(q, k_paged, v_paged, cache_seqlens=lens, block_table=clamped)
    torch.testing.assert_close(out.float(), ref_out, **OUT_TOL[q.dtype])
    torch.testing.assert_close(lse, ref_lse, **LSE_TOL[q.dtype])


@pytest.mark.cuda
def test_out_of_range_block_ids_skip_the_write():
    q, k, v, k_new, v_new = make(2, 1, 8, 2, 64, 64, seqlen_new=1)
    k_paged, v_paged, block_table = paged(k, v, 16, extra_blocks=2)
    lens = lengths(40, 20)
    bad = block_table.clone()
    bad[0, 2] = k_paged.shape[0] + 3  # sequence 0's new token (key 40) falls in an out-of-range block
    k_run, v_run = k_paged.clone(), v_paged.clone()
    flash_decode.flash_decode(q, k_run, v_run, k_new, v_new, cache_seqlens=lens, block_table=bad)
    torch.cuda.synchronize()
    # Only sequence 1's token is written, at key 20: block_table[1, 1], row 4.
    want_k, want_v = k_paged.clone(), v_paged.clone()
    block = int(block_table[1, 1])
    want_k[block, 4], want_v[block, 4] = k_new[1, 0], v_new[1, 0]
    assert torch.equal(k_run.nan_to_num(), want_k.nan_to_num())
    assert torch.equal(v_run.nan_to_num(), want_v.nan_to_num())


@pytest.mark.cuda
@pytest.mark.parametrize("rotary", [False, True])
def test_cuda_graph_replay_of_an_append_paged_step(rotary):
    """An append+paged step captured once and replayed with new lengths, new
    tokens and a changed block table written into the captured tensors."""
    q, k, v, k_new, v_new = make(3, 1, 16, 4, 128, 512, seqlen_new=1)
    k_cache, v_cache, block_table = paged(k, v, 64, extra_blocks=2)
    lens = lengths(10, 300, 500)
    kwargs = dict(cache_seqlens=lens, block_table=block_table, causal=True)
    if rotary:
        kwargs["rotary_cos"], kwargs["rotary_sin"] = rotary_tables(1024, 128, dtype=q.dtype, device="cuda")
    flash_decode.flash_decode(q, k_cache.clone(), v_cache.clone(), k_new, v_new, return_softmax_lse=True,
                              **kwargs)  # warm up: loads the kernels, registers the layout
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_decode.flash_decode(q, k_cache, v_cache, k_new, v_new, return_softmax_lse=True, **kwargs)
    for step in range(3):
        lens.add_(1 if step else 0)
        k_new.copy_(randn(*k_new.shape, seed=20 + step))
        v_new.copy_(randn(*v_new.shape, seed=30 + step))
        if step == 2:  # move sequence 2's last block to a spare one
            spare = sorted(set(range(k_cache.shape[0])) - set(block_table.flatten().tolist()))[0]
            last = int(block_table[2, 7])
            k_cache[spare], v_cache[spare] = k_cache[last], v_cache[last]
            block_table[2, 7] = spare
        ref_out, ref_lse, ref_k, ref_v = reference_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), ref_out, **OUT_TOL[q.dtype])
        torch.testing.assert_close(lse, ref_lse, **LSE_TOL[q.dtype])
        torch.testing.assert_close(k_cache, ref_k, equal_nan=True, **OUT_TOL[q.dtype])
        torch.testing.assert_close(v_cache, ref_v, equal_nan=True, **OUT_TOL[q.dtype])


def check_valid_call(args):
    """valid_args's call against the reference."""
    args = dict(args)
    q, k_cache, v_cache = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    run_and_check(q, k_cache, v_cache, args.pop("k"), args.pop("v"), tol=2.0, **args)


@pytest.mark.cuda
@pytest.mark.parametrize("paged_cache", [True, False], ids=["paged", "batch_idx"])
def test_valid_args(paged_cache):
    check_valid_call(valid_args("cuda", paged=paged_cache))


@pytest.mark.cuda
@pytest.mark.parametrize("case_id, mutate, exc, name, python", CASES, ids=IDS)
def test_bad_input_cuda(case_id, mutate, exc, name, python):
    check_refused("cuda", mutate, exc, name)


@pytest.mark.cuda
@pytest.mark.parametrize("case_id, mutate, exc, name, python", CASES, ids=IDS)
def test_bad_input_after_good_call(case_id, mutate, exc, name, python):
    # The good call's layout is cached (later calls skip the Python checks):
    # a bad call must still be refused, and the next good call still right.
    call(valid_args("cuda"))
    check_refused("cuda", mutate, exc, name)
    check_valid_call(valid_args("cuda"))


@pytest.mark.cuda
def test_works_after_errors():
    for _, mutate, exc, _, _ in CASES:
        args = valid_args("cuda")
        mutate(args)
        with pytest.raises(exc):
            call(args)
    check_valid_call(valid_args("cuda"))
