"""flash_decode on the GPU against torch SDPA in fp32 with explicit masks
(conftest.reference): dtypes, head dims, GQA/MQA, ragged and causal lengths,
split counts, strided tensors, out=, empty caches, CUDA graphs, streams and
plan()."""

import pytest
import torch

import flash_decode
from conftest import assert_matches_reference, capture, plant

pytestmark = pytest.mark.cuda

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
# The plan shapes the balanced-split tests assert were worked out on sm_90 with 132
# SMs (H100 SXM, H200); other GPUs plan otherwise, and there those tests check the
# numbers only.
PLANS_AS_ON_SM90_132 = (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
                        and torch.cuda.get_device_properties(0).multi_processor_count == 132)


def randn(*shape, dtype=torch.float16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def make(batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache, dtype=torch.float16, seed=0):
    """Random q, k_cache, v_cache."""
    return (randn(batch, seqlen_q, nheads_q, headdim, dtype=dtype, seed=seed),
            randn(batch, seqlen_cache, nheads_kv, headdim, dtype=dtype, seed=seed + 1),
            randn(batch, seqlen_cache, nheads_kv, headdim, dtype=dtype, seed=seed + 2))


def lengths(*values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def run_and_check(q, k, v, **kwargs):
    """flash_decode with return_softmax_lse, compared with the reference."""
    out, lse = flash_decode.flash_decode(q, k, v, return_softmax_lse=True, **kwargs)
    for plan_only in ("num_splits", "max_seqlen_k", "out"):
        kwargs.pop(plan_only, None)
    assert_matches_reference(out, lse, q, k, v, **kwargs)
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_headdims(dtype, headdim, seqlen_q, causal):
    q, k, v = make(4, seqlen_q, 16, 4, headdim, 515, dtype)
    run_and_check(q, k, v, cache_seqlens=lengths(515, 0, 1, 130), causal=causal)


# Every multiple of 8 up to 256 runs, padded to a compiled head dim (test_errors.py
# checks that the others are refused with the supported range).
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("headdim", [8, 40, 96, 160, 200])
def test_other_headdims_run_padded(dtype, headdim):
    q, k, v = make(3, 2, 8, 2, headdim, 300, dtype)
    run_and_check(q, k, v, cache_seqlens=lengths(300, 1, 0), causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("group", [1, 4, 5, 7, 8, 12, 16])
@pytest.mark.parametrize("nheads_kv", [1, 2], ids=["mqa", "hkv2"])
@pytest.mark.parametrize("seqlen_q", [1, 3, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(dtype, group, nheads_kv, seqlen_q, causal):
    q, k, v = make(4, seqlen_q, group * nheads_kv, nheads_kv, 128, 700, dtype)
    run_and_check(q, k, v, cache_seqlens=lengths(700, 33, 1, 0), causal=causal)


@pytest.mark.parametrize("seqlen_q", range(1, 17))
@pytest.mark.parametrize("causal", [False, True])
def test_seqlen_q(seqlen_q, causal):
    # Lengths below seqlen_q leave causal rows that see no key: out 0, lse -inf.
    q, k, v = make(5, seqlen_q, 8, 2, 128, 1000)
    run_and_check(q, k, v, cache_seqlens=lengths(0, 1, max(seqlen_q - 1, 0), seqlen_q, 1000),
                  causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_splits", [0, 1, 2, 3, 16, 17, 100, 100000])
@pytest.mark.parametrize("causal", [False, True])
def test_num_splits(dtype, num_splits, causal):
    # Planted keys (conftest.plant): a split or the last tile left out is far off.
    q, k, v = make(3, 2, 32, 8, 128, 4099, dtype)
    plant(q, k, [4099, 1, 2000])
    run_and_check(q, k, v, cache_seqlens=lengths(4099, 1, 2000), causal=causal, num_splits=num_splits)


@pytest.mark.parametrize("dtype, seqlen_q, causal", [(torch.float16, 1, False), (torch.bfloat16, 4, True)],
                         ids=["fp16-sq1", "bf16-sq4-causal"])
@pytest.mark.parametrize("planted", [False, True], ids=["random", "planted"])
def test_long_cache(dtype, seqlen_q, causal, planted):
    # Random keys: the LSE bound alone sees the last of 512 tiles left out;
    # planted ones (conftest.plant) make it far off.
    q, k, v = make(1, seqlen_q, 32, 8, 128, 32768, dtype)
    if planted:
        plant(q, k)
    run_and_check(q, k, v, causal=causal)


# More items (batch x K/V heads x row tiles) than an H200 or H100 holds at
# once (264 or 264 blocks): the planner keeps the full wave whole and splits
# only the items of the last, partial one (core.Plan.WholeItems), merging
# those rows with the combine. Ragged and empty lengths, causal, GQA with
# seqlen_q > 1, two row tiles per K/V head, every head dim.
@pytest.mark.parametrize("batch, nheads_q, nheads_kv, headdim, seqlen_q, dtype", [
    (8, 48, 48, 128, 10, torch.float16),
    (40, 32, 8, 128, 1, torch.bfloat16),
    (40, 32, 8, 256, 1, torch.float16),
    (40, 32, 8, 64, 2, torch.float16),
    (70, 64, 2, 128, 2, torch.bfloat16),
], ids=["mha-sq10", "gqa-bf16", "d256", "d64-sq2", "two-row-tiles"])
@pytest.mark.parametrize("causal", [False, True])
def test_tail_split(batch, nheads_q, nheads_kv, headdim, seqlen_q, dtype, causal):
    seqlen_cache = 1024
    plan = flash_decode.plan(batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache, dtype=dtype)
    if plan["whole_items"] == 0:
        pytest.skip(f"no partial wave on this GPU: {plan}")
    assert plan["grid"][1:] == [1, 1] and plan["combine_grid"] > 0 and plan["combine_row0"] > 0
    q, k, v = make(batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache, dtype)
    g = torch.Generator(device="cuda").manual_seed(7)
    lens = torch.randint(0, seqlen_cache + 1, (batch,), generator=g, device="cuda", dtype=torch.int32)
    lens[0], lens[-1], lens[-2] = seqlen_cache, 0, 1  # the last items are the split ones
    run_and_check(q, k, v, cache_seqlens=lens, causal=causal)


# Each combine kernel, picked by the planner from the split count and the
# rows: 4 warps a row (9-32 splits), a block for each 32 columns of a row
# (more), or a warp a row with 4 rows a block, or 16 where only that grid has
# no more blocks than stage 1 and the SMs (at most 8 splits); at head dims
# 128 and 256 (a lane's second 128-column slice; 8 column groups), and 72
# (a column group partly past the row). Ragged and empty lengths, causal.
@pytest.mark.parametrize("batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache, num_splits, combine", [
    (2, 1, 32, 8, 128, 8192, 16, "fd_combine_f16"),
    (2, 1, 8, 1, 128, 16384, 64, "fd_combine_f16_c32"),
    (2, 1, 8, 1, 128, 16384, 128, "fd_combine_f16_c32"),
    (2, 1, 16, 2, 256, 8192, 48, "fd_combine_f16_c32"),
    (2, 3, 8, 2, 72, 4096, 33, "fd_combine_f16_c32"),
    (4, 1, 8, 1, 128, 16384, 4, "fd_combine_f16_r4"),
    (1, 10, 48, 48, 128, 8192, 2, "fd_combine_f16_r16"),
    (2, 16, 24, 24, 128, 4096, 3, "fd_combine_f16_r16"),
    (2, 1, 16, 2, 256, 8192, 17, "fd_combine_f16"),
    (4, 1, 8, 1, 256, 16384, 4, "fd_combine_f16_r4"),
    (1, 10, 48, 48, 256, 4096, 2, "fd_combine_f16_r16"),
], ids=["4-warps", "column-groups", "column-groups-128", "column-groups-d256", "column-groups-d72", "narrow", "narrow-16-rows", "narrow-16-rows-ragged", "4-warps-d256", "narrow-d256",
        "narrow-16-rows-d256"])
def test_combine_kernels(batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache, num_splits, combine):
    plan = flash_decode.plan(batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache, num_splits=num_splits)
    if plan["combine"] != combine:
        pytest.skip(f"this GPU's plan merges otherwise: {plan}")
    q, k, v = make(batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache, seed=11)
    lens = lengths(*[seqlen_cache, 0, seqlen_q - 1, seqlen_cache // 3][:batch])
    plant(q, k, lens.tolist())
    run_and_check(q, k, v, cache_seqlens=lens, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("cache_seqlens", [None, 0, 1, 77, 640])
@pytest.mark.parametrize("causal", [False, True])
def test_int_cache_seqlens(cache_seqlens, causal):
    q, k, v = make(2, 3, 12, 4, 64, 640)
    run_and_check(q, k, v, cache_seqlens=cache_seqlens, causal=causal)


def test_lengths_beyond_cache_are_clamped():
    q, k, v = make(2, 1, 8, 8, 128, 256)
    run_and_check(q, k, v, cache_seqlens=lengths(10_000, -5))


def test_softmax_scale():
    q, k, v = make(2, 2, 16, 4, 128, 333)
    run_and_check(q, k, v, cache_seqlens=lengths(333, 100), softmax_scale=0.3, causal=True)


@pytest.mark.parametrize("num_splits", [0, 1, 8])
def test_strided_tensors(num_splits):
    batch, seqlen_q, hq, hkv, d, seqlen_cache = 3, 2, 16, 4, 128, 900
    # q: one part of a fused qkv projection; caches: slices of a larger buffer
    # (every other sequence, an offset window, interleaved K/V, padded rows).
    qkv = randn(batch, seqlen_q, 3, hq, d)
    q = qkv[:, :, 0]
    kv = randn(2 * batch, seqlen_cache + 100, 2, hkv + 1, d + 16, seed=5)
    k = kv[::2, 50:50 + seqlen_cache, 0, :hkv, :d]
    v = kv[1::2, 50:50 + seqlen_cache, 1, 1:, :d]
    out_buffer = torch.full((batch, hq, seqlen_q, d + 8), 7.0, dtype=torch.float16, device="cuda")
    out = out_buffer[..., :d].transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or out.is_contiguous())
    result, _ = run_and_check(q, k, v, cache_seqlens=lengths(900, 0, 31), causal=True,
                              num_splits=num_splits, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert (out_buffer[..., d:] == 7.0).all(), "wrote outside out"


@pytest.mark.parametrize("return_softmax_lse", [False, True])
def test_out_given(return_softmax_lse):
    q, k, v = make(2, 4, 8, 2, 128, 513)
    out = torch.empty_like(q)
    result = flash_decode.flash_decode(q, k, v, out=out, return_softmax_lse=return_softmax_lse)
    if return_softmax_lse:
        result, lse = result
        assert lse.shape == (2, 8, 4)
    assert result is out
    assert_matches_reference(out, None, q, k, v)


@pytest.mark.parametrize("q_kind", ["contiguous", "strided", "size-1 dim with its own stride"])
def test_new_out_is_contiguous(q_kind):
    q, k, v = make(2, 1, 32, 8, 128, 300)
    if q_kind == "strided":
        q = torch.cat([q, q], dim=-1)[..., :128]
    elif q_kind == "size-1 dim with its own stride":  # is_contiguous(), strides not the usual ones
        q = q.as_strided(q.shape, (32 * 128, 128, 128, 1))
        assert q.is_contiguous() and q.stride() != (32 * 128, 32 * 128, 128, 1)
    for _ in range(2):  # the second call takes the cached layout
        out = flash_decode.flash_decode(q, k, v)
        # One dense block with the contiguous strides; a dimension of size 1
        # may keep q's own stride (as torch.empty_like keeps it): it never
        # moves an address.
        assert out.is_contiguous()
        assert [s for n, s in zip(out.shape, out.stride()) if n > 1] == [32 * 128, 128, 1]
        assert_matches_reference(out, None, q, k, v)


@pytest.mark.parametrize("bound", [0, 1, 100, 1000, 4096, 10 ** 9], ids=lambda b: f"bound{b}")
@pytest.mark.parametrize("batch, nheads_q, nheads_kv, seqlen_q", [(1, 32, 8, 1), (3, 8, 1, 4)])
def test_max_seqlen_k(bound, batch, nheads_q, nheads_kv, seqlen_q):
    # A 32K-token cache holding at most 1000: the bound only picks the plan,
    # so bounds below, at and above the real lengths all give the right answer.
    q, k, v = make(batch, seqlen_q, nheads_q, nheads_kv, 128, 32768)
    lens = lengths(*[1000, 17, 0][:batch])
    plant(q, k, lens.tolist())
    run_and_check(q, k, v, cache_seqlens=lens, causal=True, max_seqlen_k=bound)


# A cache_seqlens tensor on a plan merging through the combine balances the
# splits by the lengths on the GPU: one long sequence among short ones takes
# most of them, equal lengths the plan's count, all lengths 0 one each.
@pytest.mark.parametrize("lens", [[32768, 1024, 1024, 1024, 1024, 1024, 1024, 1024], [32768] * 8,
                                  [0] * 8, [0, 1, 63, 64, 65, 32767, 5000, 0], [17, 0, 0, 0, 0, 0, 0, 32768]],
                         ids=["one-long", "equal", "all-empty", "edges", "long-last"])
@pytest.mark.parametrize("seqlen_q, causal", [(1, False), (4, True)])
def test_balanced_splits(lens, seqlen_q, causal):
    batch = len(lens)
    plan = flash_decode.plan(batch, seqlen_q, 32, 8, 128, 32768, seqlen=32768, lengths=True)
    if PLANS_AS_ON_SM90_132:
        assert plan["balance_splits"] > 1 and plan["num_splits"] > plan["balance_splits"]
    q, k, v = make(batch, seqlen_q, 32, 8, 128, 32768)
    plant(q, k, lens)
    run_and_check(q, k, v, cache_seqlens=lengths(*lens), causal=causal, max_seqlen_k=32768)


# A batch whose equal lengths take one split a sequence balances too: the
# long sequence takes many, through the balanced combine.
def test_balanced_splits_from_one_split():
    lens = [8192] + [512] * 22 + [0]
    plan = flash_decode.plan(len(lens), 1, 32, 8, 128, 8192, seqlen=8192, lengths=True)
    if PLANS_AS_ON_SM90_132:
        assert plan["balance_splits"] == 1 and plan["num_splits"] > 1 and plan["combine"].endswith("_bal")
    q, k, v = make(len(lens), 1, 32, 8, 128, 8192)
    plant(q, k, lens)
    run_and_check(q, k, v, cache_seqlens=lengths(*lens))


# Lengths a kernel writes just before the call must give the new lengths'
# answer: a balanced stage 1 (and its combine) may run part of its work
# while the kernel before it does, and the split counts must still come
# from the lengths that kernel wrote; at a batch within one block's threads
# and one beyond.
@pytest.mark.parametrize("batch, nheads_q, nheads_kv, seqlen_cache", [(8, 32, 8, 32768), (160, 8, 1, 2048)])
def test_balanced_splits_lengths_written_just_before(batch, nheads_q, nheads_kv, seqlen_cache):
    q, k, v = make(batch, 1, nheads_q, nheads_kv, 128, seqlen_cache)
    plan = flash_decode.plan(batch, 1, nheads_q, nheads_kv, 128, seqlen_cache, seqlen=seqlen_cache, lengths=True)
    assert "balance_splits" in plan or not PLANS_AS_ON_SM90_132
    cache_seqlens = lengths(*[seqlen_cache] * batch)
    flash_decode.flash_decode(q, k, v, cache_seqlens=cache_seqlens)  # the first lengths, read by a call
    for step, first in enumerate([(seqlen_cache, 1), (0, seqlen_cache), (5, 700)]):
        new = lengths(*[first[i] if i < 2 else (37 * (i + step)) % (seqlen_cache + 1) for i in range(batch)])
        torch.add(new, 0, out=cache_seqlens)  # a kernel on the stream, right before the call
        out = flash_decode.flash_decode(q, k, v, cache_seqlens=cache_seqlens)
        assert_matches_reference(out, None, q, k, v, cache_seqlens=new)


def test_balanced_splits_graph_replay():
    # The split counts follow the lengths a replay finds, not the captured ones.
    q, k, v = make(4, 1, 32, 8, 128, 16384)
    cache_seqlens = lengths(16384, 16384, 16384, 16384)
    graph, (out, lse) = capture(
        lambda: flash_decode.flash_decode(q, k, v, cache_seqlens=cache_seqlens, return_softmax_lse=True))
    for new in [(16384, 3, 0, 100), (0, 0, 0, 0), (1, 16384, 2, 16384)]:
        cache_seqlens.copy_(lengths(*new))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_reference(out, lse, q, k, v, cache_seqlens=cache_seqlens)


@pytest.mark.parametrize("num_splits", [0, 1, 8, 32])
def test_cuda_graph_replay_with_new_lengths(num_splits):
    q, k, v = make(3, 4, 32, 8, 128, 2048)
    cache_seqlens = lengths(2048, 5, 0)
    graph, (out, lse) = capture(lambda: flash_decode.flash_decode(
        q, k, v, cache_seqlens=cache_seqlens, causal=True, num_splits=num_splits, return_softmax_lse=True))
    for step, new in enumerate([(1, 2048, 17), (0, 0, 3), (2048, 2048, 2048), (700, 1, 2)]):
        cache_seqlens.copy_(lengths(*new))
        q.copy_(randn(*q.shape, seed=10 + step))
        graph.replay()
        assert_matches_reference(out, lse, q, k, v, cache_seqlens=cache_seqlens, causal=True)


def test_side_stream():
    q, k, v = make(2, 2, 32, 8, 128, 4096)
    _, k_new, v_new = make(2, 2, 32, 8, 128, 4096, seed=20)
    cache_seqlens = lengths(4096, 1234)
    # A first call on the default stream: the side-stream call below reuses its
    # cached layout, and must still read the stream of the moment.
    flash_decode.flash_decode(q, k, v, cache_seqlens=cache_seqlens, return_softmax_lse=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        # Keep the side stream busy, then update the cache on it: only a
        # decode that runs on the side stream (the current one) sees k_new.
        torch.cuda._sleep(50_000_000)
        k.copy_(k_new)
        v.copy_(v_new)
        out, lse = flash_decode.flash_decode(q, k, v, cache_seqlens=cache_seqlens,
                                             return_softmax_lse=True)
    torch.cuda.current_stream().wait_stream(side)
    assert_matches_reference(out, lse, q, k_new, v_new, cache_seqlens=cache_seqlens)


def test_layouts_are_cached_per_signature():
    from flash_decode import _api
    q, k, v = make(1, 1, 32, 8, 128, 2048, seed=6)
    run_and_check(q, k, v)
    n = len(_api._prepared)
    run_and_check(q, k.clone(), v.clone())  # new addresses, same layout
    assert len(_api._prepared) == n
    run_and_check(q, k, v, cache_seqlens=700)  # an int length is "an int" in the layout
    run_and_check(q, k, v, cache_seqlens=701)
    assert len(_api._prepared) == n + 1


@pytest.mark.parametrize("num_splits", [0, 20])
def test_int_cache_seqlens_changing_every_call(num_splits):
    # One layout for every length; each plans its own splits and workspace
    # (num_splits=20: the combine kernel at long lengths, one split at short ones).
    q, k, v = make(2, 2, 32, 8, 128, 3000, seed=8)
    for n in [3000, 1, 2999, 0, 1500, 3000, 64]:
        run_and_check(q, k, v, cache_seqlens=n, causal=True, num_splits=num_splits)


@pytest.mark.parametrize("cache_seqlens", [None, 0, "tensor"])
def test_empty_cache(cache_seqlens):
    # seqlen_cache 0: no row sees a key (out 0, lse -inf), whatever the lengths say.
    q, k, v = make(2, 3, 8, 2, 64, 0)
    if cache_seqlens == "tensor":
        cache_seqlens = lengths(0, 5)
    run_and_check(q, k, v, cache_seqlens=cache_seqlens, causal=True)


@pytest.mark.parametrize("num_splits", [1, 4, 40])
def test_a_nan_key_gives_nan_as_sdpa_does(num_splits):
    # A NaN key inside a sequence's length makes its group's rows NaN (out and lse),
    # whether the splits merge in one block, a cluster or the combine: a split that
    # saw it is not taken for an empty one (lse -inf) and left out. The other K/V
    # head and the other sequence are untouched.
    q, k, v = make(2, 1, 8, 2, 128, 4096)
    k[0, 1000, 1] = float("nan")
    out, lse = flash_decode.flash_decode(q, k, v, num_splits=num_splits, return_softmax_lse=True)
    assert torch.isnan(out[0, :, 4:].float()).all() and torch.isnan(lse[0, 4:]).all()
    k[0, 1000, 1] = 0.0
    want, want_lse = flash_decode.flash_decode(q, k, v, num_splits=num_splits, return_softmax_lse=True)
    torch.testing.assert_close(out[0, :, :4], want[0, :, :4], rtol=0, atol=0)
    torch.testing.assert_close(out[1], want[1], rtol=0, atol=0)
    torch.testing.assert_close(lse[1], want_lse[1], rtol=0, atol=0)


def test_small_softmax_scale():
    # 1e-30 is a normal float32: honoured, not taken for the default (1e-50 is refused).
    q, k, v = make(2, 1, 8, 2, 128, 200)
    run_and_check(q, k, v, softmax_scale=1e-30)


def test_plan():
    p = flash_decode.plan(1, 1, 32, 8, 128, 32768)
    for key in ("num_splits", "grid", "workspace_bytes", "kernel"):
        assert key in p
    assert p["num_splits"] >= 1 and p["grid"][0] == p["num_splits"]
    assert (p["workspace_bytes"] == 0) == (p["num_splits"] == 1 or p["cluster"] > 1)
    assert flash_decode.plan(1, 1, 32, 8, 128, 32768, num_splits=1)["workspace_bytes"] == 0
    if torch.cuda.get_device_capability() >= (9, 0):  # clusters: up to 16 splits merge in stage 1
        assert flash_decode.plan(1, 1, 16, 4, 128, 8192, num_splits=16)["cluster"] == 16
    p = flash_decode.plan(1, 1, 32, 8, 128, 32768, num_splits=17)
    assert p["cluster"] == 1 and p["combine_grid"] == 32 and p["workspace_bytes"] > 0
    assert flash_decode.plan(1, 1, 32, 8, 128, 32768, num_splits=5, device="cuda:0")["num_splits"] == 5
    p = flash_decode.plan(4, 2, 40, 8, 64, 8192, dtype=torch.bfloat16, device=torch.device("cuda"),
                          seqlen=100)
    assert "bf16" in p["kernel"]
    with pytest.raises(ValueError, match="invalid argument"):
        flash_decode.plan(1, 1, 12, 5, 128, 1024)
