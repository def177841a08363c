"""Attention sinks (``sinks``, float32 ``(nheads_q,)``): each row's softmax gets
``exp(sinks[h])`` more in its denominator, with no value, and the LSE includes
it. On any machine: the torch layer's checks (the layout and the call's
address, bad input refused by name before anything runs). On a GPU: against
an fp32 reference (flash_decode's own semantics, then the sink) for every form
and reduce path, CUDA graphs, torch.compile and merge_states of shards."""

import pytest
import torch

import flash_decode
from conftest import LSE_TOL, OUT_TOL
from fakes import layout_binding  # noqa: F401  (a fixture)
from serving_ref import make_paged, reference_kvcache

RUN_SINKS = 18  # the sinks address among the binding's Run arguments


def cpu_call(**kw):
    q = torch.zeros(2, 1, 8, 64, dtype=torch.float16)
    k = torch.zeros(2, 100, 2, 64, dtype=torch.float16)
    return flash_decode.flash_decode(q, k, torch.zeros_like(k), **kw)


def test_sinks_set_the_layout_and_pass_their_address(layout_binding):
    sinks = torch.zeros(8, dtype=torch.float32)
    for _ in range(2):
        cpu_call(sinks=sinks)
    cpu_call()
    (with_sinks, _), (without, _) = layout_binding.args("Prepare")
    assert with_sinks["sinks"] == 1 and without["sinks"] == 0
    assert {k: v for k, v in with_sinks.items() if k != "sinks"} == {k: v for k, v in without.items() if k != "sinks"}
    runs = layout_binding.args("Run")
    assert [r[RUN_SINKS] for r in runs] == [sinks.data_ptr(), sinks.data_ptr(), 0]


CORE = r"^flashdecode: prepare: sinks: "  # the core's message of the argument
BAD = [
    ("a list", [0.0] * 8, TypeError, r"^sinks must be a torch\.Tensor"),
    ("float16", torch.zeros(8, dtype=torch.float16), TypeError, CORE + r"wrong type: must be a torch\.float32 tensor"),
    ("float64", torch.zeros(8, dtype=torch.float64), TypeError, CORE + r"wrong type: must be a torch\.float32 tensor"),
    ("nheads_kv logits", torch.zeros(2), ValueError, CORE + r"invalid argument: must have shape \(nheads_q,\) = \(8,\)"),
    ("2-D", torch.zeros(1, 8), ValueError, CORE + r"invalid argument: must have 1 dimension"),
    ("0-D", torch.tensor(0.0), ValueError, CORE + r"invalid argument: must have 1 dimension"),
    ("strided", torch.zeros(16)[::2], ValueError, CORE + r"invalid argument: must be contiguous"),
]


@pytest.mark.parametrize("sinks, error, match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_sinks_refused_by_name_before_anything_runs(layout_binding, sinks, error, match):
    k_new = torch.zeros(2, 1, 2, 64, dtype=torch.float16)
    with pytest.raises(error, match=match):
        cpu_call(sinks=sinks)
    with pytest.raises(error, match=match):  # with an append: refused before it writes
        cpu_call(sinks=sinks, k=k_new, v=k_new, cache_seqlens=torch.zeros(2, dtype=torch.int32))
    assert layout_binding.args("Prepare") == [] and layout_binding.args("Run") == []


def test_the_custom_ops_take_sinks():
    for op in (torch.ops.flash_decode.decode, torch.ops.flash_decode.decode_append):
        assert "Tensor? sinks=None" in str(op.default._schema)


# ---- on a GPU: against the fp32 reference -------------------------------------------------

def with_sinks(out, lse, sinks):
    """out (b, sq, hq, d) and lse (b, hq, sq) of attention without sinks as they are with them:
    lse' = logaddexp(lse, sink), out' = out * exp(lse - lse') (0 for a row that saw no key)."""
    sink = sinks.float()[None, :, None]
    lse2 = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - lse2).transpose(1, 2)[..., None], lse2


def sink_logits(hq, device="cuda"):
    """Logits about the rows' own LSEs (a few nats here) and far above and below them."""
    return torch.tensor([0.0, 2.5, -1.0, 6.0, 40.0, -40.0, 4.0], device=device).repeat(hq)[:hq].contiguous()


def inputs(dtype, b, sq, hq, hkv, d, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dtype)

    return randn(b, sq, hq, d), randn(b, n, hkv, d), randn(b, n, hkv, d)


def check(dtype, sinks, q, k_cache, v_cache, **kw):
    """flash_decode with sinks against the reference of the same call, out and lse."""
    ref_kw = {name: value for name, value in kw.items() if name not in ("num_splits", "max_seqlen_k")}
    want_out, want_lse, *_ = reference_kvcache(q, k_cache, v_cache, **ref_kw)
    want_out, want_lse = with_sinks(want_out, want_lse, sinks)
    out, lse = flash_decode.flash_decode(q, k_cache, v_cache, sinks=sinks, return_softmax_lse=True, **kw)
    torch.testing.assert_close(out.float(), want_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, want_lse, **LSE_TOL[dtype])
    return out, lse


DTYPES = [torch.float16, torch.bfloat16]
IDS = ["fp16", "bf16"]
# (id, batch, seqlen_q, nheads_q, nheads_kv, headdim, cache, lengths, num_splits, causal)
PLAIN = [
    ("auto", 2, 1, 32, 8, 128, 3000, [2999, 1], 0, False),
    ("one split, empty rows", 3, 4, 16, 4, 64, 700, [0, 5, 700], 1, True),
    ("7 splits, empty rows", 3, 4, 20, 4, 64, 777, [0, 5, 777], 7, True),
    ("16 splits", 1, 1, 32, 8, 128, 8192, [8000], 16, False),
    ("48 splits", 2, 1, 16, 4, 256, 4000, [4000, 1234], 48, False),
    ("r32 causal", 1, 4, 64, 8, 128, 1500, [1500], 5, True),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("case", PLAIN, ids=[c[0] for c in PLAIN])
def test_plain(dtype, case):
    _, b, sq, hq, hkv, d, n, lens, splits, causal = case
    q, k, v = inputs(dtype, b, sq, hq, hkv, d, n)
    sinks = sink_logits(hq)
    lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = check(dtype, sinks, q, k, v, cache_seqlens=lens, causal=causal, num_splits=splits)
    empty = (lens == 0).nonzero().flatten()
    if len(empty):  # a row that sees no key: out 0, lse its sink
        assert (out[empty] == 0).all()
        torch.testing.assert_close(lse[empty], sinks[None, :, None].expand(len(empty), hq, sq), atol=1e-5, rtol=1e-6)


@pytest.mark.cuda
def test_balanced_splits():
    # Ragged lengths from a tensor, on a long cache: the splits balanced by the lengths on the device.
    b, hq, hkv, d, n = 8, 16, 2, 64, 32768
    assert flash_decode.plan(b, 1, hq, hkv, d, n, lengths=True).get("balance_splits", 0) > 0
    q, k, v = inputs(torch.float16, b, 1, hq, hkv, d, n, seed=1)
    lens = torch.tensor([3000 * (i + 1) // b for i in range(b)], dtype=torch.int32, device="cuda")
    check(torch.float16, sink_logits(hq), q, k, v, cache_seqlens=lens)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_paged_window_softcap(dtype):
    b, sq, hq, hkv, d, n = 2, 3, 32, 8, 128, 2048
    q, k, v = inputs(dtype, b, sq, hq, hkv, d, n, seed=2)
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache, table = make_paged(k, v, 16, generator=g, extra_blocks=3)
    lens = torch.tensor([2048, 700], dtype=torch.int32, device="cuda")
    sinks = sink_logits(hq)
    check(dtype, sinks, q, k_cache, v_cache, cache_seqlens=lens, block_table=table)  # the paged form
    check(dtype, sinks, q, k_cache, v_cache, cache_seqlens=lens, block_table=table, causal=True,
          window_size=(100, -1), softcap=20.0)  # the serving form, windowed


@pytest.mark.cuda
def test_append():
    dtype, b, sq, hq, hkv, d, n = torch.float16, 2, 2, 16, 4, 128, 1024
    q, k_cache, v_cache = inputs(dtype, b, sq, hq, hkv, d, n, seed=4)
    k_new, v_new = (torch.randn(b, 2, hkv, d, device="cuda").to(dtype) for _ in "kv")
    lens = torch.tensor([500, 0], dtype=torch.int32, device="cuda")
    check(dtype, sink_logits(hq), q, k_cache.clone(), v_cache.clone(), k=k_new, v=v_new, cache_seqlens=lens,
          causal=True)
    # Refused (sinks on another device): the caches are left as they were.
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match=CORE + r"invalid argument: must be on q's device"):
        flash_decode.flash_decode(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, sinks=sink_logits(hq, "cpu"))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.cuda
def test_cuda_graph_replay_reads_the_sinks_each_time():
    dtype, b, hq, hkv, d, n = torch.float16, 2, 32, 8, 128, 4096
    q, k, v = inputs(dtype, b, 1, hq, hkv, d, n, seed=5)
    lens = torch.tensor([4096, 1000], dtype=torch.int32, device="cuda")
    sinks = torch.zeros(hq, device="cuda")
    out, lse = flash_decode.flash_decode(q, k, v, cache_seqlens=lens, sinks=sinks, return_softmax_lse=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = flash_decode.flash_decode(q, k, v, cache_seqlens=lens, sinks=sinks, return_softmax_lse=True)
    for logits in (sink_logits(hq), torch.full((hq,), -30.0, device="cuda")):
        sinks.copy_(logits)
        graph.replay()
        torch.cuda.synchronize()
        want_out, want_lse, *_ = reference_kvcache(q, k, v, cache_seqlens=lens)
        want_out, want_lse = with_sinks(want_out, want_lse, sinks)
        torch.testing.assert_close(out.float(), want_out, **OUT_TOL[dtype])
        torch.testing.assert_close(lse, want_lse, **LSE_TOL[dtype])


@pytest.mark.cuda
def test_torch_compile():
    dtype, b, hq, hkv, d, n = torch.float16, 2, 16, 4, 64, 500
    q, k, v = inputs(dtype, b, 1, hq, hkv, d, n, seed=6)
    sinks = sink_logits(hq)
    fn = torch.compile(lambda q, k, v, s: flash_decode.flash_decode(q, k, v, sinks=s, return_softmax_lse=True),
                       fullgraph=True)
    out, lse = fn(q, k, v, sinks)
    want_out, want_lse = flash_decode.flash_decode(q, k, v, sinks=sinks, return_softmax_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_merge_states_of_shards_one_carrying_the_sink(dtype):
    # The keys in two shards, the sink in the first only: merged, the whole cache with the sink.
    b, hq, hkv, d, n, cut = 3, 16, 4, 128, 3000, 1100
    q, k, v = inputs(dtype, b, 1, hq, hkv, d, n, seed=7)
    sinks = sink_logits(hq)
    o1, l1 = flash_decode.flash_decode(q, k[:, :cut], v[:, :cut], sinks=sinks, return_softmax_lse=True)
    o2, l2 = flash_decode.flash_decode(q, k[:, cut:].contiguous(), v[:, cut:].contiguous(), return_softmax_lse=True)
    out, lse = flash_decode.merge_state(o1, l1.transpose(1, 2), o2, l2.transpose(1, 2))
    want_out, want_lse, *_ = reference_kvcache(q, k, v)
    want_out, want_lse = with_sinks(want_out, want_lse, sinks)
    torch.testing.assert_close(out.float(), want_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, want_lse.transpose(1, 2), **LSE_TOL[dtype])
