"""serving_ref.reference_kvcache against independent checks (CPU): torch SDPA
(conftest.reference), a row-by-row float64 implementation written in
FlashAttention's own frame (keys counted from the leftpad, windows from
``i + seqlen_k - seqlen_q``), hand formulas on tiny cases, and sliced caches.
The GPU tests trust this reference, so every feature is pinned here."""

import math

import pytest
import torch

from conftest import reference as sdpa_reference
from serving_ref import apply_rotary, gather_paged, make_paged, reference_kvcache, rotary_tables


def rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def ints(*values):
    return torch.tensor(values, dtype=torch.int32)


def random_tables(positions, rotary_dim, seed=7):
    """cos/sin of random angles, as FlashAttention's own tests use."""
    angles = torch.rand(positions, rotary_dim // 2, generator=torch.Generator().manual_seed(seed)) * 2 * math.pi
    return angles.cos(), angles.sin()


def naive_rotate(x, cos, sin, position, interleaved):
    """One vector rotated pair by pair with complex numbers (Python floats)."""
    x = [float(t) for t in x]
    half = len(cos[0])
    for j in range(half):
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
        z = complex(x[a], x[b]) * complex(cos[position][j], sin[position][j])
        x[a], x[b] = z.real, z.imag
    return x


def naive_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, rotary_cos=None, rotary_sin=None,
                  cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                  causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                  alibi_slopes=None):
    """FlashAttention's semantics one query row at a time, in float64.

    Returns (out, lse, dense k cache after, dense v cache after); the dense
    caches are (batch, capacity, nheads_kv, headdim), one row per sequence."""
    batch, seqlen_q, nheads_q, headdim = q.shape
    nheads_kv = k_cache.shape[2]
    if block_table is not None:
        dense_k, dense_v = gather_paged(k_cache, block_table), gather_paged(v_cache, block_table)
    else:
        rows = list(range(batch)) if cache_batch_idx is None else cache_batch_idx.tolist()
        dense_k, dense_v = k_cache[rows], v_cache[rows]
    dense_k, dense_v = dense_k.double().clone(), dense_v.double().clone()
    cos = None if rotary_cos is None else rotary_cos.double().tolist()
    sin = None if rotary_sin is None else rotary_sin.double().tolist()
    lengths = cache_seqlens.tolist() if isinstance(cache_seqlens, torch.Tensor) else [cache_seqlens] * batch
    leftpads = [0] * batch if cache_leftpad is None else cache_leftpad.tolist()
    seqlen_new = 0 if k is None else k.shape[1]
    scale = softmax_scale or 1 / math.sqrt(headdim)
    left, right = window_size
    if causal:
        right = 0
    local = causal or tuple(window_size) != (-1, -1)
    out = torch.zeros(batch, seqlen_q, nheads_q, headdim, dtype=torch.float64)
    lse = torch.full((batch, nheads_q, seqlen_q), -math.inf, dtype=torch.float64)
    for b in range(batch):
        length, pad = lengths[b], leftpads[b]
        for t in range(seqlen_new):
            for h in range(nheads_kv):
                key = k[b, t, h].tolist()
                if cos is not None:
                    key = naive_rotate(key, cos, sin, length + t, rotary_interleaved)
                dense_k[b, length + t, h] = torch.tensor(key, dtype=torch.float64)
                dense_v[b, length + t, h] = v[b, t, h].double()
        keys, values = dense_k[b, pad:length + seqlen_new], dense_v[b, pad:length + seqlen_new]
        seqlen_k = keys.shape[0]                       # FA's frame: key c is cache position pad + c
        for h in range(nheads_q):
            kv = h // (nheads_q // nheads_kv)
            slope = 0.0
            if alibi_slopes is not None:
                slope = float(alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h])
            for i in range(seqlen_q):
                query = q[b, i, h].tolist()
                if cos is not None:
                    query = naive_rotate(query, cos, sin, length + (i if local else 0), rotary_interleaved)
                query = torch.tensor(query, dtype=torch.float64)
                diag = i + seqlen_k - seqlen_q
                seen = []
                for c in range(seqlen_k):
                    if right >= 0 and c > diag + right:
                        continue
                    if left >= 0 and c < diag - left:
                        continue
                    s = scale * float(query @ keys[c, kv])
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    s -= slope * abs(diag - c)
                    seen.append((s, c))
                if not seen:
                    continue
                top = max(s for s, _ in seen)
                row_lse = top + math.log(sum(math.exp(s - top) for s, _ in seen))
                lse[b, h, i] = row_lse
                out[b, i, h] = sum(math.exp(s - row_lse) * values[c, kv] for s, c in seen)
    return out, lse, dense_k, dense_v


def assert_same(a, b, atol=2e-5):
    """fp32 results against fp32 or float64 ones: same infinities, close elsewhere."""
    torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=1e-5)


def clones(*tensors):
    return [t.clone() for t in tensors]


def assert_unchanged(tensors, copies):
    for t, c in zip(tensors, copies):
        assert torch.equal(t.nan_to_num(7.0), c.nan_to_num(7.0)), "the reference changed an input"


# --- plain attention ------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_plain_matches_sdpa(causal, seqlen_q):
    q, k, v = rand(4, seqlen_q, 8, 16, seed=1), rand(4, 37, 2, 16, seed=2), rand(4, 37, 2, 16, seed=3)
    lens = ints(37, 0, 1, 20)
    out, lse, k_after, v_after = reference_kvcache(q, k, v, cache_seqlens=lens, causal=causal)
    ref_out, ref_lse = sdpa_reference(q, k, v, cache_seqlens=lens, causal=causal)
    assert_same(out, ref_out)
    assert_same(lse, ref_lse)
    assert torch.equal(k_after, k) and torch.equal(v_after, v)


def test_lengths_default_to_capacity_and_clamp_without_append():
    q, k, v = rand(2, 1, 4, 8, seed=1), rand(2, 12, 2, 8, seed=2), rand(2, 12, 2, 8, seed=3)
    full = reference_kvcache(q, k, v)[:2]
    for got, want in zip(reference_kvcache(q, k, v, cache_seqlens=ints(99, 12))[:2], full):
        assert torch.equal(got, want)
    out, lse, _, _ = reference_kvcache(q, k, v, cache_seqlens=ints(-3, 12))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


# --- paged ----------------------------------------------------------------------------------------

FULL = dict(causal=True, window_size=(9, -1), softcap=3.0, rotary_interleaved=False)


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
def test_paged_equals_contiguous(page_size, append):
    batch, capacity, nheads_kv, headdim = 3, 40, 2, 16
    q = rand(batch, 3, 4, headdim, seed=1)
    k_dense, v_dense = rand(batch, capacity, nheads_kv, headdim, seed=2), rand(batch, capacity, nheads_kv, headdim, seed=3)
    k_paged, v_paged, table = make_paged(k_dense, v_dense, page_size, generator=torch.Generator().manual_seed(5),
                                         extra_blocks=4)
    kwargs = dict(FULL, cache_seqlens=ints(38, 0, 17) if append else ints(40, 0, 17),
                  alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    if append:
        new_k, new_v = rand(batch, 2, nheads_kv, headdim, seed=4), rand(batch, 2, nheads_kv, headdim, seed=6)
        cos, sin = random_tables(64, 8)
        kwargs.update(k=new_k, v=new_v, rotary_cos=cos, rotary_sin=sin)
    inputs = [q, k_paged, v_paged, table]
    copies = clones(*inputs)
    paged = reference_kvcache(q, k_paged, v_paged, block_table=table, **kwargs)
    assert_unchanged(inputs, copies)
    dense = reference_kvcache(q, k_dense, v_dense, **kwargs)
    assert_same(paged[0], dense[0], atol=1e-6)
    assert_same(paged[1], dense[1], atol=1e-6)
    for after_paged, after_dense in zip(paged[2:], dense[2:]):
        assert torch.equal(gather_paged(after_paged, table, capacity), after_dense)
    # Slots that no sequence owns are still the fill value: nothing was written outside the table.
    owned = torch.zeros(k_paged.shape[0], dtype=torch.bool)
    owned[table.long().flatten()] = True
    assert torch.isnan(paged[2][~owned]).all()


def test_paged_reads_only_the_blocks_it_needs():
    """Block-table entries past a sequence's last position may hold anything."""
    q, k, v = rand(2, 1, 4, 8, seed=1), rand(2, 32, 2, 8, seed=2), rand(2, 32, 2, 8, seed=3)
    k_paged, v_paged, table = make_paged(k, v, 4, generator=torch.Generator().manual_seed(0))
    lens = ints(5, 8)
    table[:, 2:] = -1
    got = reference_kvcache(q, k_paged, v_paged, cache_seqlens=lens, block_table=table)
    want = reference_kvcache(q, k, v, cache_seqlens=lens)
    assert_same(got[0], want[0], atol=1e-6)


def test_make_paged():
    k, v = rand(3, 10, 2, 4, seed=1), rand(3, 10, 2, 4, seed=2)
    k_paged, v_paged, table = make_paged(k, v, 4, generator=torch.Generator().manual_seed(3), extra_blocks=2)
    assert table.dtype == torch.int32 and table.shape == (3, 3) and k_paged.shape == (11, 4, 2, 4)
    assert len(set(table.flatten().tolist())) == 9
    assert table.flatten().tolist() != list(range(9)), "shuffle=True should scatter the blocks"
    assert torch.equal(gather_paged(k_paged, table, 10), k) and torch.equal(gather_paged(v_paged, table, 10), v)
    assert torch.isnan(gather_paged(k_paged, table)[:, 10:]).all()
    _, _, plain = make_paged(k, v, 4, shuffle=False)
    assert plain.flatten().tolist() == list(range(9))
    with pytest.raises(ValueError):
        make_paged(k, v, 0)


# --- windows and causal ---------------------------------------------------------------------------

def test_window_minus_one_is_no_window():
    q, k, v = rand(3, 4, 4, 8, seed=1), rand(3, 30, 2, 8, seed=2), rand(3, 30, 2, 8, seed=3)
    lens = ints(30, 9, 2)
    got = reference_kvcache(q, k, v, cache_seqlens=lens, window_size=(-1, -1))
    ref_out, ref_lse = sdpa_reference(q, k, v, cache_seqlens=lens)
    assert_same(got[0], ref_out)
    assert_same(got[1], ref_lse)
    wide = reference_kvcache(q, k, v, cache_seqlens=lens, window_size=(30, 30))
    assert torch.equal(wide[0], got[0]) and torch.equal(wide[1], got[1])


@pytest.mark.parametrize("left", [-1, 0, 5])
def test_causal_equals_window_right_zero(left):
    q, k, v = rand(2, 4, 4, 16, seed=1), rand(2, 24, 2, 16, seed=2), rand(2, 24, 2, 16, seed=3)
    cos, sin = random_tables(32, 16)
    kwargs = dict(k=rand(2, 3, 2, 16, seed=4), v=rand(2, 3, 2, 16, seed=5), rotary_cos=cos, rotary_sin=sin,
                  cache_seqlens=ints(10, 1), cache_leftpad=ints(2, 0))
    causal = reference_kvcache(q, k, v, causal=True, window_size=(left, 7), **kwargs)
    window = reference_kvcache(q, k, v, window_size=(left, 0), **kwargs)
    for a, b in zip(causal, window):
        assert torch.equal(a, b)


@pytest.mark.parametrize("window", [(0, -1), (3, -1), (3, 0), (3, 8)])
def test_sliding_window_is_attention_over_the_last_keys(window):
    """One query row at position end - 1: a window of left w sees exactly the
    last w + 1 keys, whatever the right side allows past the end."""
    q, k, v = rand(3, 1, 4, 8, seed=1), rand(3, 20, 2, 8, seed=2), rand(3, 20, 2, 8, seed=3)
    lens = [20, 9, 2]
    out, lse, _, _ = reference_kvcache(q, k, v, cache_seqlens=ints(*lens), window_size=window)
    for b, length in enumerate(lens):
        first = max(0, length - 1 - window[0])
        want_out, want_lse = sdpa_reference(q[b:b + 1], k[b:b + 1, first:length], v[b:b + 1, first:length])
        assert_same(out[b:b + 1], want_out)
        assert_same(lse[b:b + 1], want_lse)


@pytest.mark.parametrize("window,causal", [((2, 1), False), ((0, 0), False), ((-1, 2), False),
                                           ((4, -1), True), ((-1, -1), True)])
def test_windows_match_naive(window, causal):
    q, k, v = rand(2, 5, 4, 8, seed=1), rand(2, 16, 2, 8, seed=2), rand(2, 16, 2, 8, seed=3)
    kwargs = dict(cache_seqlens=ints(16, 7), cache_leftpad=ints(3, 1), window_size=window, causal=causal)
    got = reference_kvcache(q, k, v, **kwargs)
    want = naive_kvcache(q, k, v, **kwargs)
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


# --- softcap and ALiBi ----------------------------------------------------------------------------

def tiny():
    q = torch.tensor([[[[1.0, 2.0]]]])                                        # (1, 1, 1, 2)
    k = torch.tensor([[[[3.0, 1.0]], [[-2.0, 4.0]], [[0.5, 0.5]]]])            # (1, 3, 1, 2)
    v = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]], [[2.0, 2.0]]]])
    return q, k, v


def softmax_by_hand(logits, values):
    lse = math.log(sum(math.exp(z) for z in logits))
    out = [sum(math.exp(z - lse) * vj[c] for z, vj in zip(logits, values)) for c in range(2)]
    return out, lse


def test_softcap_formula():
    q, k, v = tiny()
    scale, cap = 0.7, 2.0
    out, lse, _, _ = reference_kvcache(q, k, v, softmax_scale=scale, softcap=cap)
    dots = [1 * 3 + 2 * 1, 1 * -2 + 2 * 4, 1 * 0.5 + 2 * 0.5]
    want_out, want_lse = softmax_by_hand([cap * math.tanh(scale * d / cap) for d in dots],
                                         [[1, 0], [0, 1], [2, 2]])
    assert out[0, 0, 0].tolist() == pytest.approx(want_out, rel=1e-6)
    assert lse.item() == pytest.approx(want_lse, rel=1e-6)


def test_alibi_is_added_after_softcap():
    q, k, v = tiny()
    scale, cap, slope = 0.7, 2.0, 0.3
    out, lse, _, _ = reference_kvcache(q, k, v, softmax_scale=scale, softcap=cap,
                                       alibi_slopes=torch.tensor([slope]))
    dots = [5, 6, 1.5]
    # One query row at position 2 (bottom-right), keys at 0, 1, 2.
    logits = [cap * math.tanh(scale * d / cap) - slope * abs(2 - j) for j, d in enumerate(dots)]
    want_out, want_lse = softmax_by_hand(logits, [[1, 0], [0, 1], [2, 2]])
    assert out[0, 0, 0].tolist() == pytest.approx(want_out, rel=1e-6)
    assert lse.item() == pytest.approx(want_lse, rel=1e-6)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes_h", "slopes_bh"])
def test_alibi_matches_hand_built_bias(causal, per_batch):
    """Bias -slope * |i + seqlen_k - seqlen_q - c| over the valid keys c (counted
    from the leftpad), added to SDPA's scores as a float mask."""
    batch, seqlen_q, nheads_q, nheads_kv, headdim = 2, 3, 4, 2, 8
    q, k, v = rand(batch, seqlen_q, nheads_q, headdim, seed=1), rand(batch, 20, nheads_kv, headdim, seed=2), \
        rand(batch, 20, nheads_kv, headdim, seed=3)
    slopes = torch.rand(batch, nheads_q, generator=torch.Generator().manual_seed(4)) * 0.5
    if not per_batch:
        slopes = slopes[0]
    lens, pads = [20, 11], [0, 4]
    out, lse, _, _ = reference_kvcache(q, k, v, cache_seqlens=ints(*lens), cache_leftpad=ints(*pads),
                                       causal=causal, alibi_slopes=slopes)
    for b in range(batch):
        keys, values = k[b, pads[b]:lens[b]], v[b, pads[b]:lens[b]]
        seqlen_k = keys.shape[0]
        bias = torch.zeros(nheads_q, seqlen_q, seqlen_k)
        for h in range(nheads_q):
            slope = float(slopes[b, h] if per_batch else slopes[h])
            for i in range(seqlen_q):
                for c in range(seqlen_k):
                    if causal and c > i + seqlen_k - seqlen_q:
                        bias[h, i, c] = -math.inf
                    else:
                        bias[h, i, c] = -slope * abs(i + seqlen_k - seqlen_q - c)
        qh = q[b].transpose(0, 1)                                                    # (hq, sq, d)
        kh = keys.repeat_interleave(2, dim=1).transpose(0, 1)
        vh = values.repeat_interleave(2, dim=1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias)
        assert_same(out[b], want.transpose(0, 1))
        assert_same(lse[b], torch.logsumexp(qh @ kh.transpose(-1, -2) / math.sqrt(headdim) + bias, dim=-1))


# --- append, rotary, cache_batch_idx --------------------------------------------------------------

@pytest.mark.parametrize("page_size", [None, 1, 16])
def test_append_writes_the_new_rows_and_attends_to_them(page_size):
    batch, capacity, nheads_kv, headdim = 3, 32, 2, 8
    q = rand(batch, 2, 4, headdim, seed=1)
    k_dense, v_dense = rand(batch, capacity, nheads_kv, headdim, seed=2), rand(batch, capacity, nheads_kv, headdim, seed=3)
    new_k, new_v = rand(batch, 3, nheads_kv, headdim, seed=4), rand(batch, 3, nheads_kv, headdim, seed=5)
    lens = [0, 29, 10]
    if page_size is None:
        k_cache, v_cache, table = k_dense, v_dense, None
    else:
        k_cache, v_cache, table = make_paged(k_dense, v_dense, page_size, generator=torch.Generator().manual_seed(6))
    inputs = [q, k_cache, v_cache, new_k, new_v]
    copies = clones(*inputs)
    out, lse, k_after, v_after = reference_kvcache(q, k_cache, v_cache, new_k, new_v, cache_seqlens=ints(*lens),
                                                   block_table=table, causal=True)
    assert_unchanged(inputs, copies)
    if table is not None:
        k_after, v_after = gather_paged(k_after, table, capacity), gather_paged(v_after, table, capacity)
    want_k, want_v = k_dense.clone(), v_dense.clone()
    for b, length in enumerate(lens):
        want_k[b, length:length + 3], want_v[b, length:length + 3] = new_k[b], new_v[b]
    assert torch.equal(k_after, want_k) and torch.equal(v_after, want_v)
    ref_out, ref_lse = sdpa_reference(q, want_k, want_v, cache_seqlens=ints(*lens) + 3, causal=True)
    assert_same(out, ref_out)
    assert_same(lse, ref_lse)


def test_append_with_leftpad_writes_at_cache_seqlens():
    """Leftpad marks where the valid keys start; the new rows still go to
    cache_seqlens, and attention covers [leftpad, cache_seqlens + seqlen_new)."""
    q, k, v = rand(2, 1, 4, 8, seed=1), rand(2, 16, 2, 8, seed=2), rand(2, 16, 2, 8, seed=3)
    new_k, new_v = rand(2, 2, 2, 8, seed=4), rand(2, 2, 2, 8, seed=5)
    lens, pads = [9, 5], [4, 5]
    out, lse, k_after, v_after = reference_kvcache(q, k, v, new_k, new_v, cache_seqlens=ints(*lens),
                                                   cache_leftpad=ints(*pads))
    for b in range(2):
        assert torch.equal(k_after[b, lens[b]:lens[b] + 2], new_k[b])
        assert torch.equal(k_after[b, :lens[b]], k[b, :lens[b]]) and torch.equal(k_after[b, lens[b] + 2:], k[b, lens[b] + 2:])
        keys, values = k_after[b:b + 1, pads[b]:lens[b] + 2], v_after[b:b + 1, pads[b]:lens[b] + 2]
        want_out, want_lse = sdpa_reference(q[b:b + 1], keys, values)
        assert_same(out[b:b + 1], want_out)
        assert_same(lse[b:b + 1], want_lse)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_apply_rotary_matches_naive(interleaved, rotary_dim):
    x = rand(2, 3, 2, 16, seed=1)
    cos, sin = random_tables(20, rotary_dim)
    positions = torch.tensor([[0, 5, 19], [7, 7, 2]])
    got = apply_rotary(x, cos, sin, positions, interleaved)
    for b in range(2):
        for s in range(3):
            for h in range(2):
                want = naive_rotate(x[b, s, h], cos.tolist(), sin.tolist(), int(positions[b, s]), interleaved)
                assert got[b, s, h].tolist() == pytest.approx(want, abs=1e-6)
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])


def test_rotary_tables():
    cos, sin = rotary_tables(6, 8, base=100.0)
    assert cos.shape == (6, 4)
    assert cos[3, 1].item() == pytest.approx(math.cos(3 * 100.0 ** (-2 / 8)), rel=1e-6)
    assert sin[5, 3].item() == pytest.approx(math.sin(5 * 100.0 ** (-6 / 8)), rel=1e-6)


@pytest.mark.parametrize("mode", ["plain", "causal", "local"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_rotary_positions(mode, interleaved):
    """Rotary inside the call equals rotating q and k beforehand at FA's
    positions: new key t at cache_seqlens + t; query row i at cache_seqlens + i
    when causal or local, else every row at cache_seqlens; leftpad shifts nothing."""
    batch, seqlen_q, headdim = 2, 3, 16
    q, k, v = rand(batch, seqlen_q, 4, headdim, seed=1), rand(batch, 24, 2, headdim, seed=2), rand(batch, 24, 2, headdim, seed=3)
    new_k, new_v = rand(batch, 2, 2, headdim, seed=4), rand(batch, 2, 2, headdim, seed=5)
    cos, sin = random_tables(30, 8)
    lens, pads = ints(12, 20), ints(3, 0)
    opts = dict(causal=mode == "causal", window_size=(6, 2) if mode == "local" else (-1, -1),
                cache_seqlens=lens, cache_leftpad=pads)
    got = reference_kvcache(q, k, v, new_k, new_v, rotary_cos=cos, rotary_sin=sin,
                            rotary_interleaved=interleaved, **opts)
    rows = torch.arange(seqlen_q) if mode != "plain" else torch.zeros(seqlen_q, dtype=torch.long)
    q_pos = lens.long()[:, None] + rows[None]
    k_pos = lens.long()[:, None] + torch.arange(2)[None]
    want = reference_kvcache(apply_rotary(q, cos, sin, q_pos, interleaved), k, v,
                             apply_rotary(new_k, cos, sin, k_pos, interleaved), new_v, **opts)
    for a, b in zip(got, want):
        assert_same(a, b, atol=1e-6)
    naive = naive_kvcache(q, k, v, new_k, new_v, rotary_cos=cos, rotary_sin=sin,
                          rotary_interleaved=interleaved, **opts)
    for a, b in zip(got, naive):
        assert_same(a, b)


def test_rotated_keys_are_stored_in_the_cache_dtype():
    q, k, v = rand(1, 1, 2, 16, seed=1, dtype=torch.float16), rand(1, 8, 1, 16, seed=2, dtype=torch.float16), \
        rand(1, 8, 1, 16, seed=3, dtype=torch.float16)
    new_k, new_v = rand(1, 1, 1, 16, seed=4, dtype=torch.float16), rand(1, 1, 1, 16, seed=5, dtype=torch.float16)
    cos, sin = rotary_tables(8, 16, dtype=torch.float16)
    out, lse, k_after, v_after = reference_kvcache(q, k, v, new_k, new_v, rotary_cos=cos, rotary_sin=sin,
                                                   cache_seqlens=3)
    assert out.dtype == lse.dtype == torch.float32 and k_after.dtype == torch.float16
    assert torch.equal(k_after[0, 3], apply_rotary(new_k, cos, sin, torch.tensor([[3]]), True)[0, 0].half())
    assert torch.equal(v_after[0, 3], new_v[0, 0])


@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
def test_cache_batch_idx_selects_cache_rows(append):
    q, k, v = rand(3, 2, 4, 8, seed=1), rand(5, 16, 2, 8, seed=2), rand(5, 16, 2, 8, seed=3)
    idx = ints(3, 0, 4)
    kwargs = dict(cache_seqlens=ints(16 - 2 * append, 4, 0), causal=True)
    if append:
        kwargs.update(k=rand(3, 2, 2, 8, seed=4), v=rand(3, 2, 2, 8, seed=5))
    out, lse, k_after, v_after = reference_kvcache(q, k, v, cache_batch_idx=idx, **kwargs)
    want = reference_kvcache(q, k[idx.long()], v[idx.long()], **kwargs)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert torch.equal(k_after[idx.long()], want[2]) and torch.equal(v_after[idx.long()], want[3])
    assert torch.equal(k_after[[1, 2]], k[[1, 2]]) and torch.equal(v_after[[1, 2]], v[[1, 2]])


# --- everything at once against the naive implementation ------------------------------------------

CASES = {
    "gqa-append-rotary-causal": dict(causal=True, rotary=True, append=2, interleaved=True),
    "neox-local-softcap-alibi": dict(window_size=(5, 1), softcap=4.0, alibi=True, rotary=True, append=1,
                                     interleaved=False),
    "leftpad-alibi-causal": dict(causal=True, alibi=True, leftpad=True),
    "batch-idx-append-window": dict(batch_idx=True, append=3, window_size=(-1, 2)),
    "paged-everything": dict(page_size=5, causal=True, window_size=(7, -1), softcap=2.5, alibi=True,
                             rotary=True, append=2, interleaved=False, leftpad=True),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_against_naive(case):
    opts = CASES[case]
    batch, seqlen_q, nheads_q, nheads_kv, headdim, capacity = 3, 4, 6, 2, 16, 24
    q = rand(batch, seqlen_q, nheads_q, headdim, seed=1)
    rows = batch + 2 if opts.get("batch_idx") else batch
    k_dense, v_dense = rand(rows, capacity, nheads_kv, headdim, seed=2), rand(rows, capacity, nheads_kv, headdim, seed=3)
    append = opts.get("append", 0)
    kwargs = dict(cache_seqlens=ints(capacity - append, 9, 3), causal=opts.get("causal", False),
                  window_size=opts.get("window_size", (-1, -1)), softcap=opts.get("softcap", 0.0),
                  rotary_interleaved=opts.get("interleaved", True))
    if append:
        kwargs.update(k=rand(batch, append, nheads_kv, headdim, seed=4), v=rand(batch, append, nheads_kv, headdim, seed=5))
    if opts.get("rotary"):
        kwargs["rotary_cos"], kwargs["rotary_sin"] = random_tables(capacity + seqlen_q, 8)
    if opts.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(batch, nheads_q, generator=torch.Generator().manual_seed(8))
    if opts.get("leftpad"):
        kwargs["cache_leftpad"] = ints(5, 9, 0)
    k_cache, v_cache = k_dense, v_dense
    if opts.get("batch_idx"):
        kwargs["cache_batch_idx"] = ints(4, 1, 2)
    if opts.get("page_size"):
        k_cache, v_cache, kwargs["block_table"] = make_paged(k_dense, v_dense, opts["page_size"],
                                                             generator=torch.Generator().manual_seed(9))
    out, lse, k_after, v_after = reference_kvcache(q, k_cache, v_cache, **kwargs)
    want_out, want_lse, want_k, want_v = naive_kvcache(q, k_cache, v_cache, **kwargs)
    assert_same(out, want_out)
    assert_same(lse, want_lse)
    if "block_table" in kwargs:
        k_after, v_after = gather_paged(k_after, kwargs["block_table"]), gather_paged(v_after, kwargs["block_table"])
    elif "cache_batch_idx" in kwargs:
        k_after, v_after = k_after[kwargs["cache_batch_idx"].long()], v_after[kwargs["cache_batch_idx"].long()]
    assert_same(k_after.nan_to_num(7.0), want_k.nan_to_num(7.0), atol=1e-6)
    assert_same(v_after.nan_to_num(7.0), want_v.nan_to_num(7.0), atol=1e-6)


# --- rows that see no key -------------------------------------------------------------------------

def test_rows_without_keys_give_zero_and_minus_inf():
    q, k, v = rand(4, 4, 4, 8, seed=1), rand(4, 16, 2, 8, seed=2), rand(4, 16, 2, 8, seed=3)
    out, lse, _, _ = reference_kvcache(q, k, v, cache_seqlens=ints(0, 2, 6, 6), cache_leftpad=ints(0, 0, 6, 1),
                                       causal=True, window_size=(1, -1))
    # Sequence 0: no keys. Sequence 1: 2 keys, rows 0 and 1 sit before them. Sequence 2:
    # leftpad == length. Sequence 3: keys 1..5, every row sees its window.
    empty = torch.zeros(4, 4, dtype=torch.bool)
    empty[0], empty[1, :2], empty[2] = True, True, True
    for b in range(4):
        for i in range(4):
            if empty[b, i]:
                assert torch.equal(out[b, i], torch.zeros_like(out[b, i]))
                assert torch.isneginf(lse[b, :, i]).all()
            else:
                assert torch.isfinite(lse[b, :, i]).all() and out[b, i].abs().sum() > 0


# --- arguments ------------------------------------------------------------------------------------

def bad_cases():
    q, k, v = rand(2, 1, 4, 8), rand(2, 10, 2, 8), rand(2, 10, 2, 8)
    new = rand(2, 3, 2, 8)
    cos, sin = random_tables(16, 8)
    k_paged, v_paged, table = make_paged(k, v, 4)
    return [
        ("batch idx and block table", (q, k_paged, v_paged), dict(block_table=table, cache_batch_idx=ints(0, 1))),
        ("append past capacity", (q, k, v, new, new), dict(cache_seqlens=ints(8, 0))),
        ("append without lengths", (q, k, v, new, new), {}),
        ("k without v", (q, k, v, new), dict(cache_seqlens=2)),
        ("rotary without append", (q, k, v), dict(rotary_cos=cos, rotary_sin=sin)),
        ("rotary table too short", (q, k, v, new, new), dict(cache_seqlens=ints(7, 0), rotary_cos=cos[:9],
                                                              rotary_sin=sin[:9])),
        ("leftpad past length", (q, k, v), dict(cache_seqlens=ints(3, 3), cache_leftpad=ints(4, 0))),
        ("repeated batch idx with append", (q, k, v, new, new), dict(cache_seqlens=2, cache_batch_idx=ints(1, 1))),
        ("alibi shape", (q, k, v), dict(alibi_slopes=torch.ones(3))),
    ]


@pytest.mark.parametrize("index", range(len(bad_cases())), ids=[name for name, _, _ in bad_cases()])
def test_bad_arguments_raise(index):
    _, args, kwargs = bad_cases()[index]
    with pytest.raises(ValueError):
        reference_kvcache(*args, **kwargs)
