"""merge_states / merge_state: argument errors (on any machine where they come
before the device check) and, on a GPU, the merge of attention states built by
torch SDPA over chunks of keys against attention over all the keys at once:
dtypes, state counts, empty states, stacked and list inputs, strided LSEs, row
layouts, head dims, flash_decode's own results, CUDA graphs and streams."""


import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_decode
from conftest import LSE_TOL, OUT_TOL, assert_names, has_extension, reference

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]
# The fp32 merge against fp32 SDPA: both round only in float32.
TOL = {**OUT_TOL, torch.float32: dict(atol=1e-5, rtol=1e-4)}
MERGED_LSE_TOL = dict(atol=1e-4, rtol=1e-5)  # the LSEs are float32 throughout
CORE = "^flashdecode: merge_states: "  # the Go core's messages


# ---- argument errors ----------------------------------------------------------------

R, D = (2, 3), 8  # rows and head dim of the states in the cases below


def valid(device, n=3, dtype=torch.float16):
    """outs and lses of n states, lists of tensors."""
    g = torch.Generator().manual_seed(0)
    outs = [torch.randn(*R, D, generator=g).to(device, dtype) for _ in range(n)]
    lses = [torch.randn(*R, generator=g).to(device) for _ in range(n)]
    return dict(outs=outs, lses=lses)


def stacked(a):
    return dict(outs=torch.stack(a["outs"]), lses=torch.stack(a["lses"]))


def change(key, i, fn):
    """A mutation applying fn to item i of a[key] (i None: to a[key])."""
    def mutate(a):
        if i is None:
            a[key] = fn(a[key])
        else:
            a[key] = list(a[key])
            a[key][i] = fn(a[key][i])
    return mutate


def strided_last(t):
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def with_headdim(d):
    def mutate(a):
        a["outs"] = [torch.zeros(*R, d, dtype=t.dtype, device=t.device) for t in a["outs"]]
    return mutate


# (id, mutation of valid(), stacked inputs, exception, argument name, reached on CPU tensors)
CASES = [
    ("outs-int", lambda a: a.update(outs=1), False, TypeError, "outs", True),
    ("outs-none", lambda a: a.update(outs=None), False, TypeError, "outs", True),
    ("outs-item-not-tensor", change("outs", 1, lambda t: t.tolist()), False, TypeError, "outs", True),
    ("outs-empty-list", lambda a: a.update(outs=[], lses=[]), False, ValueError, "outs", True),
    ("outs-no-states", lambda a: a.update(outs=a["outs"][:0]), True, ValueError, "outs", True),
    ("outs-rank1", lambda a: a.update(outs=a["outs"][0, 0, 0]), True, ValueError, "outs", True),
    ("outs-item-0d", change("outs", None, lambda ts: [t[0, 0, 0] for t in ts]), False, ValueError, "outs", True),
    ("outs-float64", change("outs", None, lambda t: t.double()), True, TypeError, "outs", True),
    ("outs-int32", change("outs", None, lambda ts: [t.int() for t in ts]), False, TypeError, "outs", True),
    ("outs-item-dtype", change("outs", 2, lambda t: t.float()), False, TypeError, "outs", True),
    ("outs-item-shape", change("outs", 1, lambda t: t[:1]), False, ValueError, "outs", True),
    ("headdim-6", with_headdim(6), False, NotImplementedError, "headdim", False),  # the Go core's
    ("headdim-2", with_headdim(2), False, NotImplementedError, "headdim", False),
    ("headdim-260", with_headdim(260), False, NotImplementedError, "headdim", False),
    ("outs-last-dim-strided", change("outs", None, strided_last), True, ValueError, "outs", True),
    ("outs-item-last-dim-strided", change("outs", 0, strided_last), False, ValueError, "outs", True),
    ("lses-str", lambda a: a.update(lses="lse"), False, TypeError, "lses", True),
    ("lses-item-not-tensor", change("lses", 0, lambda t: 1.0), False, TypeError, "lses", True),
    ("lses-empty-list", lambda a: a.update(lses=[]), False, ValueError, "lses", True),
    ("lses-too-few", lambda a: a.update(lses=a["lses"][:2]), False, ValueError, "lses", True),
    ("lses-stacked-too-many", lambda a: a.update(lses=torch.cat([a["lses"], a["lses"]])), True,
     ValueError, "lses", True),
    ("lses-rows", change("lses", None, lambda t: t[..., :2]), True, ValueError, "lses", True),
    ("lses-with-headdim", change("lses", None, lambda ts: [t[..., None] for t in ts]), False,
     ValueError, "lses", True),
    ("lses-item-shape", change("lses", 2, lambda t: t[:1]), False, ValueError, "lses", True),
    ("lses-float16", change("lses", None, lambda t: t.half()), True, TypeError, "lses", True),
    ("lses-item-dtype", change("lses", None, lambda ts: [t.double() for t in ts]), False,
     TypeError, "lses", True),
    ("outs-on-cpu", change("outs", None, lambda ts: [t.cpu() for t in ts]), False, ValueError, "outs", True),
    ("outs-item-on-cpu", change("outs", 1, lambda t: t.cpu()), False, ValueError, "outs", False),
    ("lses-on-cpu", change("lses", None, lambda t: t.cpu()), True, ValueError, "lses", False),
]
IDS = [c[0] for c in CASES]


def check_raises(device, mutate, stack, exc, name):
    args = valid(device)
    if stack:
        args = stacked(args)
    mutate(args)
    with pytest.raises(exc) as info:
        flash_decode.merge_states(args["outs"], args["lses"])
    assert_names(info.value, exc, name)


@pytest.mark.skipif(not has_extension(), reason="needs the built extension")
@pytest.mark.parametrize("case_id, mutate, stack, exc, name, cpu_ok", CASES, ids=IDS)
def test_bad_input_cpu(case_id, mutate, stack, exc, name, cpu_ok):
    if not cpu_ok:  # on CPU tensors the first device error is outs'
        exc, name = ValueError, "outs"
    check_raises("cpu", mutate, stack, exc, name)


@pytest.mark.skipif(not has_extension(), reason="needs the built extension")
def test_cpu_tensors_rejected_without_a_gpu():
    with pytest.raises(ValueError, match=CORE + "outs: invalid argument: must be on a CUDA device"):
        flash_decode.merge_states(**stacked(valid("cpu")))
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()


MERGE_STATE_CASES = [
    ("out_a-not-tensor", 0, lambda t: None, TypeError, "out_a"),
    ("out_b-dtype", 2, lambda t: t.float(), TypeError, "out_b"),
    ("out_b-shape", 2, lambda t: t[:1], ValueError, "out_b"),
    ("lse_a-shape", 1, lambda t: t[:1], ValueError, "lse_a"),
    ("lse_b-shape", 3, lambda t: t[:1], ValueError, "lse_b"),
    ("lse_a-dtype", 1, lambda t: t.half(), TypeError, "lse_a"),
    ("lse_b-dtype", 3, lambda t: t.double(), TypeError, "lse_b"),
]


@pytest.mark.skipif(not has_extension(), reason="needs the built extension")
@pytest.mark.parametrize("case_id, index, fn, exc, name", MERGE_STATE_CASES, ids=[c[0] for c in MERGE_STATE_CASES])
def test_merge_state_names_its_arguments(case_id, index, fn, exc, name):
    a = valid("cpu", n=2)
    args = [a["outs"][0], a["lses"][0], a["outs"][1], a["lses"][1]]
    args[index] = fn(args[index])
    with pytest.raises(exc) as info:
        flash_decode.merge_state(*args)
    assert_names(info.value, exc, name)


@pytest.mark.cuda
def test_merge_state_of_an_unsupported_headdim():
    a = valid("cuda", n=2)
    with pytest.raises(NotImplementedError) as info:
        flash_decode.merge_state(a["outs"][0][..., :6], a["lses"][0], a["outs"][1][..., :6], a["lses"][1])
    assert_names(info.value, NotImplementedError, "headdim")


@pytest.mark.cuda
@pytest.mark.parametrize("case_id, mutate, stack, exc, name, cpu_ok", CASES, ids=IDS)
def test_bad_input_cuda(case_id, mutate, stack, exc, name, cpu_ok):
    check_raises("cuda", mutate, stack, exc, name)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_lses_on_another_gpu():
    a = valid("cuda:0")
    with pytest.raises(ValueError, match=CORE + r"lses\[0\]: invalid argument: must be on the device of outs\[0\]"):
        flash_decode.merge_states(a["outs"], [t.to("cuda:1") for t in a["lses"]])


@pytest.mark.cuda
def test_misaligned_or_strided_outs_say_what_is_supported():
    a = stacked(valid("cuda"))
    outs = a["outs"]
    buf = torch.empty(outs.numel() + 2, dtype=outs.dtype, device=outs.device)
    shifted = buf[2:].view(outs.shape)  # 4 bytes off: fp16 loads take 8-byte alignment
    shifted.copy_(outs)
    with pytest.raises(NotImplementedError, match=r"\bouts\b.*not 8-byte aligned"):
        flash_decode.merge_states(shifted, a["lses"])
    wide = torch.zeros(*outs.shape[:-1], D + 2, dtype=outs.dtype, device=outs.device)
    with pytest.raises(NotImplementedError, match=r"\bouts\b.*not a multiple of 4"):
        flash_decode.merge_states(wide[..., :D], a["lses"])  # rows D + 2 elements apart
    out, lse = flash_decode.merge_states(outs, a["lses"])  # and it still works
    torch.testing.assert_close(out.float(), merge_reference(outs, a["lses"])[0], **TOL[outs.dtype])


# ---- merging on the GPU ---------------------------------------------------------------

def attention_states(num_states, b, sq, h, d, dtype, seed=0, chunk=40):
    """Attention of random queries over num_states chunks of random keys, by
    SDPA in fp32: each chunk gives a state, and all the keys at once the
    reference. Chunk lengths vary per sequence; state 1 (with two or more
    states) has no key, and sequence 0 none in any state.

    Returns (outs, lses, want_out, want_lse): outs a list of (b, sq, h, d) in
    dtype, lses a list of (b, h, sq) float32, want_out (b, sq, h, d) fp32 and
    want_lse (b, h, sq): flash_decode's layouts.
    """
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    q = randn(b, h, sq, d)
    keys, values = randn(num_states, b, h, chunk, d), randn(num_states, b, h, chunk, d)
    lens = torch.randint(1, chunk + 1, (num_states, b), generator=g, device="cuda")
    if num_states > 1:
        lens[1] = 0
    lens[:, 0] = 0
    mask = torch.arange(chunk, device="cuda") < lens[..., None]  # (states, b, chunk)
    scale = d ** -0.5

    def attend(k, v, m):  # m (b, keys): out (b, sq, h, d), lse (b, h, sq); no key: 0, -inf
        m = m[:, None, None, :]
        with sdpa_kernel(SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scale)
        out = torch.where(m.any(-1, keepdim=True), out, torch.zeros_like(out))
        lse = torch.logsumexp((q @ k.transpose(-1, -2) * scale).masked_fill(~m, float("-inf")), dim=-1)
        return out.transpose(1, 2), lse

    outs, lses = [], []
    for s in range(num_states):
        out, lse = attend(keys[s], values[s], mask[s])
        outs.append(out.to(dtype))
        lses.append(lse)
    every = lambda x: x.transpose(0, 1).transpose(1, 2).reshape(b, h, num_states * chunk, d)
    want_out, want_lse = attend(every(keys), every(values), mask.transpose(0, 1).reshape(b, -1))
    return outs, lses, want_out, want_lse


def merge_reference(outs, lses):
    """The merge formula in float64 on stacked states (outs (n, *rows, d), lses
    (n, *rows)): states of weight 0 left out; no state: out 0, lse -inf."""
    lses = lses.double()
    m = lses.amax(0)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.exp(lses - m)
    total = w.sum(0)
    o = torch.where(w[..., None] > 0, outs.double(), 0) * w[..., None]
    o = torch.where(total[..., None] > 0, o.sum(0) / total[..., None], 0)
    return o.float(), (m + torch.log(total)).float()


def check(out, lse, want_out, want_lse, dtype):
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out.float(), want_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, want_lse, **MERGED_LSE_TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_states", [2, 3, 7, 20])
@pytest.mark.parametrize("form", ["list", "stacked"])
def test_merge_states_matches_attention_over_all_keys(dtype, num_states, form):
    outs, lses, want_out, want_lse = attention_states(num_states, 3, 2, 4, 128, dtype)
    # flash_decode's layouts: out (b, sq, h, d) with lse (b, h, sq), read transposed.
    if form == "list":
        out, lse = flash_decode.merge_states(outs, [x.transpose(1, 2) for x in lses])
    else:
        stacked_lses = torch.stack(lses).transpose(2, 3)  # (n, b, sq, h), strided
        assert not stacked_lses.is_contiguous()
        out, lse = flash_decode.merge_states(torch.stack(outs), stacked_lses)
    check(out, lse, want_out, want_lse.transpose(1, 2), dtype)
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # sequence 0 saw no key


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_merge_state(dtype):
    outs, lses, want_out, want_lse = attention_states(2, 4, 1, 8, 64, dtype, seed=1)
    out, lse = flash_decode.merge_state(outs[0], lses[0].transpose(1, 2), outs[1], lses[1].transpose(1, 2))
    check(out, lse, want_out, want_lse.transpose(1, 2), dtype)
    torch.testing.assert_close(lse, torch.logaddexp(lses[0], lses[1]).transpose(1, 2), **MERGED_LSE_TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_empty_states_weigh_nothing(dtype):
    # Rows where every state is empty, rows where all but one are, and empty
    # states whose outputs hold NaN and inf (as SDPA gives a fully masked row).
    n, rows, d = 5, 6, 32
    g = torch.Generator(device="cuda").manual_seed(2)
    outs = torch.randn(n, rows, d, generator=g, device="cuda").to(dtype)
    lses = torch.randn(n, rows, generator=g, device="cuda") * 5
    lses[:, 0] = float("-inf")
    lses[1:, 1] = float("-inf")
    lses[2] = float("-inf")
    outs[:, 0] = float("nan")
    outs[1:, 1] = float("inf")
    outs[2] = float("nan")
    out, lse = flash_decode.merge_states(outs, lses)
    want_out, want_lse = merge_reference(outs, lses)
    check(out, lse, want_out, want_lse, dtype)
    assert (out[0] == 0).all() and torch.isneginf(lse[0])
    torch.testing.assert_close(out[1].float(), outs[0, 1].float(), atol=0, rtol=0)  # one live state: itself
    torch.testing.assert_close(lse[1], lses[0, 1], atol=1e-6, rtol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_nan_or_inf_lse_gives_nan_not_an_empty_state(bad):
    # An LSE of -inf means "empty, weighs nothing": a NaN or +inf LSE must give NaN
    # (as core.MergeStatesReference does), never -inf, which a later merge would drop.
    outs = torch.randn(3, 4, 2, 64, device="cuda", dtype=torch.float16)
    lses = torch.randn(3, 4, 2, device="cuda")
    lses[1, 2, 1] = bad
    out, lse = flash_decode.merge_states(outs, lses)
    assert torch.isnan(lse[2, 1]) and torch.isnan(out[2, 1].float()).all()
    lses[1, 2, 1] = 0.0
    want_out, want_lse = merge_reference(outs, lses)
    keep = torch.ones(4, 2, dtype=torch.bool, device="cuda")
    keep[2, 1] = False
    check(out[keep], lse[keep], want_out[keep], want_lse[keep], torch.float16)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("headdim", [4, 8, 60, 100, 128, 192, 256])
def test_headdims(dtype, headdim):
    outs, lses, want_out, want_lse = attention_states(3, 2, 1, 3, headdim, dtype, seed=headdim)
    out, lse = flash_decode.merge_states(outs, [x.transpose(1, 2) for x in lses])
    check(out, lse, want_out, want_lse.transpose(1, 2), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [(), (7,), (3, 5), (2, 3, 4), (2, 1, 3, 4), (2, 3, 4, 5)],
                         ids=lambda r: f"rows{len(r)}")
@pytest.mark.parametrize("num_states", [1, 4, 9, 130])
def test_row_shapes_and_state_counts(rows, num_states):
    # Any number of row dimensions whose strides join into three (contiguous
    # ones do); 9 and 130 states: more than one warp, more than one round.
    g = torch.Generator(device="cuda").manual_seed(3)
    outs = torch.randn(num_states, *rows, 64, generator=g, device="cuda")
    lses = torch.randn(num_states, *rows, generator=g, device="cuda") * 3
    out, lse = flash_decode.merge_states(outs, lses)
    check(out, lse, *merge_reference(outs, lses), torch.float32)
    if num_states <= 8:
        out, lse = flash_decode.merge_states(list(outs), list(lses))
        check(out, lse, *merge_reference(outs, lses), torch.float32)


@pytest.mark.cuda
def test_strided_rows_that_do_not_join():
    # Rows (2, 3, 4) of outs sliced from a wider buffer and lses permuted: 3
    # row dimensions with their own strides run; 4 that cannot join do not.
    g = torch.Generator(device="cuda").manual_seed(4)
    buf = torch.randn(5, 2, 6, 4, 72, generator=g, device="cuda", dtype=torch.bfloat16)
    outs = buf[:, :, 1:4, :, 4:68]  # (5, 2, 3, 4, 64)
    lses = torch.randn(5, 4, 2, 3, generator=g, device="cuda").permute(0, 2, 3, 1)
    out, lse = flash_decode.merge_states(outs, lses)
    check(out, lse, *merge_reference(outs, lses), torch.bfloat16)
    outs4 = torch.randn(2, 4, 6, 8, 10, 8, device="cuda")[:, ::2, ::2, ::2, ::2]  # 4 row dims, none joined
    with pytest.raises(NotImplementedError, match=CORE + "outs: not supported: with lses: the strides of the 4 row dim"):
        flash_decode.merge_states(outs4, torch.randn(2, 2, 3, 4, 5, device="cuda"))


@pytest.mark.cuda
def test_list_of_different_strides_and_more_than_8():
    g = torch.Generator(device="cuda").manual_seed(5)
    outs = [torch.randn(4, 6, 32, generator=g, device="cuda") for _ in range(3)]
    outs[1] = torch.randn(6, 4, 32, generator=g, device="cuda").transpose(0, 1)  # other strides: stacked
    lses = [torch.randn(4, 6, generator=g, device="cuda") for _ in range(3)]
    out, lse = flash_decode.merge_states(outs, lses)
    check(out, lse, *merge_reference(torch.stack(outs), torch.stack(lses)), torch.float32)
    many = [torch.randn(4, 32, generator=g, device="cuda") for _ in range(11)]
    many_lses = [torch.randn(4, generator=g, device="cuda") for _ in range(11)]
    out, lse = flash_decode.merge_states(many, many_lses)
    check(out, lse, *merge_reference(torch.stack(many), torch.stack(many_lses)), torch.float32)


@pytest.mark.cuda
def test_no_rows():
    out, lse = flash_decode.merge_states(torch.zeros(3, 0, 4, 16, device="cuda"), torch.zeros(3, 0, 4, device="cuda"))
    assert out.shape == (0, 4, 16) and lse.shape == (0, 4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cascade_of_flash_decode_results(dtype):
    # A prefix every sequence shares, then each sequence's own keys (some
    # none): flash_decode over each, merged, is flash_decode over both.
    b, hq, hkv, d, prefix, suffix = 4, 16, 4, 128, 1000, 300
    g = torch.Generator(device="cuda").manual_seed(6)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    q = randn(b, 1, hq, d)
    k_prefix, v_prefix = randn(1, prefix, hkv, d), randn(1, prefix, hkv, d)
    k, v = randn(b, suffix, hkv, d), randn(b, suffix, hkv, d)
    lens = torch.tensor([300, 0, 1, 123], dtype=torch.int32, device="cuda")
    o1, l1 = flash_decode.flash_decode(q, k_prefix.expand(b, -1, -1, -1), v_prefix.expand(b, -1, -1, -1),
                                       return_softmax_lse=True)
    o2, l2 = flash_decode.flash_decode(q, k, v, cache_seqlens=lens, return_softmax_lse=True)
    out, lse = flash_decode.merge_state(o1, l1.transpose(1, 2), o2, l2.transpose(1, 2))
    k_all = torch.cat([k_prefix.expand(b, -1, -1, -1), k], dim=1)
    v_all = torch.cat([v_prefix.expand(b, -1, -1, -1), v], dim=1)
    want_out, want_lse = reference(q, k_all, v_all, cache_seqlens=lens + prefix)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, want_lse.transpose(1, 2), **LSE_TOL[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("num_states", [2, 20])
def test_cuda_graph_replay_with_new_states(num_states):
    outs, lses, _, _ = attention_states(num_states, 2, 3, 4, 64, torch.float16, seed=7)
    outs, lses = torch.stack(outs), torch.stack(lses).transpose(2, 3)
    call = lambda: flash_decode.merge_states(outs, lses)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (module, kernel lookup) off the capture
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    for step in range(3):
        new_outs, new_lses, want_out, want_lse = attention_states(num_states, 2, 3, 4, 64, torch.float16,
                                                                  seed=8 + step)
        outs.copy_(torch.stack(new_outs))
        lses.copy_(torch.stack(new_lses).transpose(2, 3))
        graph.replay()
        check(out, lse, want_out, want_lse.transpose(1, 2), torch.float16)


@pytest.mark.cuda
def test_runs_on_the_current_stream():
    outs, lses, _, _ = attention_states(3, 2, 1, 4, 64, torch.float32, seed=9)
    new_outs, new_lses, want_out, want_lse = attention_states(3, 2, 1, 4, 64, torch.float32, seed=10)
    outs, lses = torch.stack(outs), torch.stack(lses)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Keep the side stream busy, then write the states on it: only a merge
        # that runs on the side stream (the current one) sees them.
        torch.cuda._sleep(50_000_000)
        outs.copy_(torch.stack(new_outs))
        lses.copy_(torch.stack(new_lses))
        out, lse = flash_decode.merge_states(outs, lses.transpose(2, 3))
    torch.cuda.current_stream().wait_stream(side)
    check(out, lse, want_out, want_lse.transpose(1, 2), torch.float32)
