"""batch_invariant=True: a sequence's output and LSE bits are the same alone and in any batch (random
batch sizes 1-256, random other lengths, caches and bounds, paged or not), eagerly and replayed from a
CUDA graph; and the plans behind that, which need no GPU."""

import random

import pytest
import torch

import flash_decode
from conftest import assert_matches_reference, capture, has_extension
from fakes import layout_binding  # noqa: F401  (a fixture)

needs_extension = pytest.mark.skipif(not has_extension(), reason="native extension not built/installed")

HEADS_Q, HEADS_KV = 8, 2


# ---- the plans (no GPU: device=-1 plans for the default H200-like device) ----

@needs_extension
@pytest.mark.parametrize("kwargs", [dict(), dict(serving=True, page_size=16), dict(seqlen_new=1, serving=True),
                                    dict(serving=True, window_size=(1000, 0))],
                         ids=["contiguous", "paged", "append", "window"])
@pytest.mark.parametrize("seqlen_q,headdim", [(1, 128), (4, 128), (2, 64)])
def test_plan_is_the_same_for_any_batch(kwargs, seqlen_q, headdim):
    def keys(p):
        return (p["variant"]["kernel"], p["merge"], p["combine"], p["invariant_tiles"],
                p.get("invariant_span_tiles", 0), p["num_splits"], p["grid"][:2], p["combine_threads"])

    first = None
    for batch in (1, 2, 3, 17, 64, 255, 256):
        p = flash_decode.plan(batch, seqlen_q, 32, 8, headdim, 32768, lengths=True, batch_invariant=True,
                              device=-1, **kwargs)
        assert p["merge"] == "invariant" and p["grid"][2] == batch
        assert p["combine"].endswith("_bal") and p["combine_grid"] == batch * 32 * seqlen_q
        first = first or keys(p)
        assert keys(p) == first, batch


@needs_extension
def test_plan_tile_budget():
    # Head dim 128, fp16: 256 KiB of K and V a split, 512 keys (8 tiles of 64), whatever the batch.
    p = flash_decode.plan(8, 1, 32, 8, 128, 32768, lengths=True, batch_invariant=True, device=-1)
    assert p["invariant_tiles"] == 8 and p["num_splits"] == 64 and p["grid"] == [64, 8, 8]
    # A bound of 512 keys: every sequence is one split, which stage 1 writes itself.
    p = flash_decode.plan(8, 1, 32, 8, 128, 32768, seqlen=512, lengths=True, batch_invariant=True, device=-1)
    assert p["merge"] == "none" and p["workspace_bytes"] == 0 and p["invariant_tiles"] == 8
    assert "invariant_tiles" not in flash_decode.plan(8, 1, 32, 8, 128, 32768, lengths=True, device=-1)


@needs_extension
def test_plan_refuses_num_splits():
    with pytest.raises(ValueError, match="num_splits"):
        flash_decode.plan(2, 1, 32, 8, 128, 4096, num_splits=4, batch_invariant=True, device=-1)


def test_batch_invariant_must_be_a_bool(layout_binding):
    q = torch.zeros(2, 1, HEADS_Q, 64, dtype=torch.float16)
    k = torch.zeros(2, 100, HEADS_KV, 64, dtype=torch.float16)
    for fn in (lambda: flash_decode.flash_decode(q, k, k, batch_invariant=1),
               lambda: flash_decode.plan(2, 1, 8, 2, 64, 100, batch_invariant=1, device=-1)):
        with pytest.raises(TypeError, match="batch_invariant must be a bool"):
            fn()


def test_flag_reaches_the_layout(layout_binding):
    q = torch.zeros(2, 1, HEADS_Q, 64, dtype=torch.float16)
    k = torch.zeros(2, 100, HEADS_KV, 64, dtype=torch.float16)
    flash_decode.flash_decode(q, k, k, batch_invariant=True)
    flash_decode.flash_decode(q, k, k)
    layouts = [layout for layout, _ in layout_binding.args("Prepare")]
    assert [layout["batch_invariant"] for layout in layouts] == [1, 0]  # a layout each


# ---- the bits, on a GPU ----

class Sequence:
    """One sequence's q (1, seqlen_q, heads_q, headdim) and keys and values (length, HEADS_KV, headdim)."""

    def __init__(self, length, seqlen_q=1, headdim=128, dtype=torch.float16, heads_q=HEADS_Q, seed=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.length = length
        self.q = torch.randn(1, seqlen_q, heads_q, headdim, dtype=dtype, device="cuda", generator=g)
        self.k = torch.randn(length, HEADS_KV, headdim, dtype=dtype, device="cuda", generator=g)
        self.v = torch.randn(length, HEADS_KV, headdim, dtype=dtype, device="cuda", generator=g)


def batch_of(seq, batch, pos, cache, page_size, rng):
    """A batch of `batch` sequences with seq at pos, the others random, in a cache of `cache` keys a
    sequence (paged: pages of page_size, shuffled, the others' tables pointing anywhere).
    Returns (q, k_cache, v_cache, cache_seqlens, block_table or None)."""
    g = torch.Generator(device="cuda").manual_seed(rng.randrange(1 << 30))
    _, seqlen_q, heads, d = seq.q.shape
    q = torch.randn(batch, seqlen_q, heads, d, dtype=seq.q.dtype, device="cuda", generator=g)
    q[pos] = seq.q[0]
    lens = torch.tensor([rng.randint(0, cache) for _ in range(batch)], dtype=torch.int32)
    lens[pos] = seq.length
    if not page_size:
        k = torch.randn(batch, cache, HEADS_KV, d, dtype=seq.q.dtype, device="cuda", generator=g)
        v = torch.randn_like(k)
        k[pos, :seq.length], v[pos, :seq.length] = seq.k, seq.v
        return q, k, v, lens.cuda(), None
    own, per = -(-seq.length // page_size), cache // page_size
    pages = own + 8
    k = torch.randn(pages, page_size, HEADS_KV, d, dtype=seq.q.dtype, device="cuda", generator=g)
    v = torch.randn_like(k)
    order = torch.randperm(pages, device="cuda", generator=g)[:own]
    padded = own * page_size
    k_seq = torch.zeros(padded, HEADS_KV, d, dtype=k.dtype, device="cuda")
    v_seq = torch.zeros_like(k_seq)
    k_seq[:seq.length], v_seq[:seq.length] = seq.k, seq.v
    k[order], v[order] = k_seq.view(own, page_size, HEADS_KV, d), v_seq.view(own, page_size, HEADS_KV, d)
    table = torch.randint(0, pages, (batch, per), dtype=torch.int32, device="cuda", generator=g)
    table[pos, :own] = order.to(torch.int32)
    return q, k, v, lens.cuda(), table


def alone(seq, page_size, **kwargs):
    cache = -(-seq.length // page_size) * page_size if page_size else seq.length
    q, k, v, lens, table = batch_of(seq, 1, 0, cache, page_size, random.Random(0))
    return flash_decode.flash_decode(q, k, v, cache_seqlens=lens, block_table=table, batch_invariant=True,
                                     return_softmax_lse=True, **kwargs)


def same_bits(got, want):
    (out, lse), (want_out, want_lse) = got, want
    return torch.equal(out.view(torch.int16), want_out.view(torch.int16)) and \
        torch.equal(lse.view(torch.int32), want_lse.view(torch.int32))


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "paged"])
@pytest.mark.parametrize("length,seqlen_q,headdim,dtype,heads_q", [
    (5000, 1, 128, torch.float16, 8),     # 4 rows a block: 10 splits of 512 keys
    (300, 2, 64, torch.bfloat16, 8),      # one split
    (20000, 4, 128, torch.bfloat16, 8),   # 16 rows a block: 20 splits of 1024 keys
    (9000, 4, 128, torch.float16, 16),    # 32 rows a block: 5 splits of 2048 keys
    (3000, 1, 256, torch.bfloat16, 2),    # d256 MHA: 12 splits of 256 keys
])
def test_bits_alone_and_in_random_batches(page_size, length, seqlen_q, headdim, dtype, heads_q):
    seq = Sequence(length, seqlen_q, headdim, dtype, heads_q)
    want = alone(seq, page_size, causal=True)
    rng = random.Random(length + page_size)
    for i in range(20):
        batch = rng.randint(1, 256)
        pos = rng.randrange(batch)
        step = page_size or 1
        cache = -(-(length + rng.choice((0, rng.randint(0, 2 * length)))) // step) * step
        q, k, v, lens, table = batch_of(seq, batch, pos, cache, page_size, rng)
        bound = int(lens.max()) if i % 2 else None  # max_seqlen_k, or the whole cache
        out, lse = flash_decode.flash_decode(q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                                             batch_invariant=True, return_softmax_lse=True, max_seqlen_k=bound)
        assert same_bits((out[pos:pos + 1], lse[pos:pos + 1]), want), (i, batch, pos, cache, bound)


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [0, 16], ids=["contiguous", "paged"])
def test_bits_replayed_from_a_cuda_graph(page_size):
    # One graph captured over a batch of 96; replayed with the sequence moved to other places among
    # other lengths, its bits are those of the eager call alone.
    seq = Sequence(7000, seed=1)
    want = alone(seq, page_size)
    rng = random.Random(5)
    batch, cache = 96, 16384
    q, k, v, lens, table = batch_of(seq, batch, 0, cache, page_size, rng)
    graph, (out, lse) = capture(lambda: flash_decode.flash_decode(
        q, k, v, cache_seqlens=lens, block_table=table, batch_invariant=True, return_softmax_lse=True))
    for _ in range(20):
        pos = rng.randrange(batch)
        q2, k2, v2, lens2, table2 = batch_of(seq, batch, pos, cache, page_size, rng)
        q.copy_(q2), k.copy_(k2), v.copy_(v2), lens.copy_(lens2)
        if table is not None:
            table.copy_(table2)
        graph.replay()
        torch.cuda.synchronize()
        assert same_bits((out[pos:pos + 1], lse[pos:pos + 1]), want), pos


@pytest.mark.cuda
def test_alone_matches_the_reference():
    seq = Sequence(5000, seqlen_q=2, headdim=128)
    out, lse = alone(seq, 0, causal=True)
    assert_matches_reference(out, lse, seq.q, seq.k[None], seq.v[None], causal=True)
