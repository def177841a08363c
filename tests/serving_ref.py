"""A plain fp32 reference for flash_decode's serving arguments, with the
semantics of FlashAttention 2's ``flash_attn_with_kvcache``, and the helpers
the GPU tests use to build paged caches and rotary tables.

``reference_kvcache`` takes exactly flash_decode's arguments and returns
``(out, lse, k_cache_after, v_cache_after)``: out ``(batch, seqlen_q,
nheads_q, headdim)`` and lse ``(batch, nheads_q, seqlen_q)`` in fp32, and
copies of the caches (their layout and dtype) as they must look after the
call. It never changes its inputs. It works one sequence at a time on
whatever device the inputs are on: slow, but every step is visible.

The semantics, per sequence b (FA2's docstring and kernels):

* Storage. Contiguous: sequence b owns row ``cache_batch_idx[b]`` (default b)
  of ``k_cache`` ``(batch_cache, capacity, nheads_kv, headdim)``. Paged:
  ``k_cache`` is ``(num_blocks, page_size, nheads_kv, headdim)`` and logical
  position p of sequence b lives in block ``block_table[b, p // page_size]``
  at offset ``p % page_size``; capacity = ``block_table.shape[1] * page_size``.
  Only the positions a sequence uses are read or written, so block-table
  entries past them may hold anything. cache_batch_idx with block_table is an
  error, as in FA2.
* Lengths. ``L = cache_seqlens[b]`` (default: capacity) counts cache
  positions from 0, leftpad included; FA never changes cache_seqlens. Without
  append L is clamped to [0, capacity], as flash_decode's kernels do; with
  append it must satisfy ``L + seqlen_new <= capacity``.
* Append. With k, v ``(batch, seqlen_new, nheads_kv, headdim)``, new token t
  is written at position ``L + t`` (leftpad does not move it), then attention
  runs over positions ``[P, end)`` with ``P = cache_leftpad[b]`` (default 0)
  and ``end = L + seqlen_new``.
* Rotary (only with append). ``rotary_cos/sin`` ``(seqlen_ro, rotary_dim /
  2)`` rotate the first rotary_dim channels. New key t is rotated at
  position ``L + t``. Query row i is rotated at position ``L + i`` if causal
  or if window_size != (-1, -1), else every row at position L. Positions are
  cache positions: leftpad does not shift them. interleaved=True pairs
  channels (2j, 2j+1) (GPT-J); False pairs (j, j + rotary_dim/2) (GPT-NeoX).
  The rotated q and k are rounded to the inputs' dtype, which is what a
  kernel that keeps them in that dtype (and writes k into the cache) sees.
* Masks, aligned bottom-right: query row i sits at position
  ``d_i = end - seqlen_q + i``. It sees key position j iff ``P <= j < end``,
  ``j <= d_i + right`` if right >= 0 and ``j >= d_i - left`` if left >= 0,
  with ``(left, right) = window_size`` and right forced to 0 by causal. A
  negative side means that side is unbounded.
* Scores: ``s = softmax_scale * q.k`` (default 1/sqrt(headdim)); then softcap
  ``s = softcap * tanh(s / softcap)`` if softcap > 0; then ALiBi
  ``s -= slope[h] * |d_i - j|`` (slopes ``(nheads_q,)`` or
  ``(batch, nheads_q)``), added after the softcap and never capped.
* Output: softmax over the visible keys; lse = logsumexp of the final
  scores (natural log). A row that sees no key gets out = 0 and lse = -inf.
* GQA: query head h reads kv head ``h // (nheads_q // nheads_kv)``.

Query rows are rotated at ``L + i`` but masked at ``end - seqlen_q + i``; the
two agree when seqlen_new == seqlen_q, the usual case, and FA keeps both as
they are otherwise.

Where this contract differs from FA2's kernels (the same outputs, fewer limits):
a row with no key has lse -inf (FA2's unsplit kernel returns +inf); with
causal, ALiBi is the docstring's ``-slope * |d_i - j|`` (FA2's causal kernel
adds ``slope * (j - P)``, which gives the same out but shifts lse by a
per-row constant); any page size >= 1 (FA2: multiples of 256), any even
rotary_dim (FA2: multiples of 16), and leftpad together with block_table
(FA2 refuses that pair).
"""

import torch

__all__ = ["reference_kvcache", "make_paged", "gather_paged", "apply_rotary", "rotary_tables"]


def apply_rotary(x, cos, sin, positions, interleaved):
    """Rotary embedding of x ``(batch, seqlen, nheads, headdim)`` at integer
    ``positions`` ``(batch, seqlen)`` into the tables ``cos, sin``
    ``(seqlen_ro, rotary_dim / 2)``. Channels past rotary_dim pass through.
    Returns fp32."""
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} is larger than headdim {x.shape[-1]}")
    positions = positions.to(device=cos.device, dtype=torch.long)
    c = cos.float()[positions].to(x.device).unsqueeze(-2)   # (batch, seqlen, 1, half)
    s = sin.float()[positions].to(x.device).unsqueeze(-2)
    xf = x.float()
    rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated, rest), dim=-1)


def rotary_tables(max_positions, rotary_dim, *, base=10000.0, dtype=torch.float32, device=None):
    """The usual rotary tables: ``cos, sin`` ``(max_positions, rotary_dim / 2)``
    of angle ``p * base ** (-2j / rotary_dim)``, computed in fp32 and cast."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
    angles = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def make_paged(k_dense, v_dense, page_size, *, shuffle=True, generator=None, extra_blocks=0,
               fill=float("nan")):
    """Paged copies of dense caches ``(batch, seqlen, nheads_kv, headdim)``.

    Sequence b gets ``ceil(seqlen / page_size)`` blocks (at least one); there
    are ``extra_blocks`` more that no sequence owns. With shuffle the block
    ids are a random permutation (``torch.randperm`` with generator), so the
    blocks of a sequence are scattered and out of order. Slots that hold no
    dense position (the tail of a last block, the extra blocks) are set to
    ``fill``: NaN by default, so that reading them, or multiplying a masked
    probability by them, shows in the result.

    Returns ``(k_cache_paged, v_cache_paged, block_table)`` with caches
    ``(num_blocks, page_size, nheads_kv, headdim)`` and block_table
    ``(batch, blocks_per_sequence)`` int32, all on k_dense's device.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    batch, seqlen, nheads_kv, headdim = k_dense.shape
    pages = max(1, -(-seqlen // page_size))
    num_blocks = batch * pages + extra_blocks
    if shuffle:
        order = torch.randperm(num_blocks, generator=generator)
    else:
        order = torch.arange(num_blocks)
    block_table = order[:batch * pages].view(batch, pages).to(torch.int32).to(k_dense.device)
    ids = block_table.flatten().long()
    paged = []
    for dense in (k_dense, v_dense):
        cache = torch.full((num_blocks, page_size, nheads_kv, headdim), fill,
                           dtype=dense.dtype, device=dense.device)
        padded = torch.full((batch, pages * page_size, nheads_kv, headdim), fill,
                            dtype=dense.dtype, device=dense.device)
        padded[:, :seqlen] = dense
        cache[ids] = padded.view(batch * pages, page_size, nheads_kv, headdim)
        paged.append(cache)
    return paged[0], paged[1], block_table


def gather_paged(cache, block_table, seqlen=None):
    """The dense view ``(batch, seqlen, nheads_kv, headdim)`` of a paged cache:
    every block of every row of block_table, in order, cut to seqlen
    (default: all of them)."""
    batch, pages = block_table.shape
    page_size = cache.shape[1]
    dense = cache[block_table.long().flatten()].reshape(batch, pages * page_size, *cache.shape[2:])
    return dense if seqlen is None else dense[:, :seqlen]


def _per_sequence(value, batch, name):
    """An int or a (batch,) tensor as a list of batch Python ints."""
    if isinstance(value, int):
        return [value] * batch
    if not isinstance(value, torch.Tensor) or value.shape != (batch,):
        raise ValueError(f"{name} must be an int or a tensor of shape ({batch},)")
    return [int(x) for x in value.tolist()]


def reference_kvcache(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None,
                      cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                      softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                      return_softmax_lse=False, out=None):
    """flash_decode's result by the semantics in this module's docstring.

    num_splits, return_softmax_lse and out are accepted, and ignored, so that
    one set of keyword arguments serves both calls.

    Returns ``(out, lse, k_cache_after, v_cache_after)``: out and lse in fp32,
    the caches as copies in k_cache's layout and dtype.
    """
    del num_splits, return_softmax_lse, out
    batch, seqlen_q, nheads_q, headdim = q.shape
    nheads_kv = k_cache.shape[2]
    if nheads_q % nheads_kv:
        raise ValueError(f"nheads_q {nheads_q} is not a multiple of nheads_kv {nheads_kv}")
    group = nheads_q // nheads_kv
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be used with block_table")
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have {batch} rows, got {block_table.shape[0]}")
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
    else:
        capacity = k_cache.shape[1]

    appending = k is not None or v is not None
    if appending and (k is None or v is None):
        raise ValueError("k and v must be given together")
    seqlen_new = k.shape[1] if appending else 0
    if appending and cache_seqlens is None:
        raise ValueError("cache_seqlens is required with k and v")
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary and (rotary_cos is None or rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary and not appending:
        raise ValueError("rotary_cos/rotary_sin need k and v: rotary is applied on append")
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    rows_by_position = causal or tuple(window_size) != (-1, -1)  # rotary positions of q
    scale = headdim ** -0.5 if softmax_scale is None else float(softmax_scale)

    lengths = _per_sequence(capacity if cache_seqlens is None else cache_seqlens, batch, "cache_seqlens")
    leftpads = _per_sequence(0 if cache_leftpad is None else cache_leftpad, batch, "cache_leftpad")
    rows = list(range(batch)) if cache_batch_idx is None else _per_sequence(
        cache_batch_idx, batch, "cache_batch_idx")
    if appending and len(set(rows)) != len(rows):
        raise ValueError("cache_batch_idx must not repeat a row when k and v are appended")
    if any(not 0 <= r < k_cache.shape[0] for r in rows):
        raise ValueError("cache_batch_idx holds a row outside k_cache")
    if alibi_slopes is not None:
        slopes = alibi_slopes.float().to(q.device)
        if slopes.shape == (nheads_q,):
            slopes = slopes.expand(batch, nheads_q)
        elif slopes.shape != (batch, nheads_q):
            raise ValueError(f"alibi_slopes must be ({nheads_q},) or ({batch}, {nheads_q})")

    k_after, v_after = k_cache.clone(), v_cache.clone()
    out = torch.zeros(batch, seqlen_q, nheads_q, headdim, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, nheads_q, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device)

    for b in range(batch):
        length, leftpad = lengths[b], leftpads[b]
        if appending:
            if length < 0 or length + seqlen_new > capacity:
                raise ValueError(f"sequence {b}: cache_seqlens {length} + {seqlen_new} new tokens "
                                 f"does not fit a capacity of {capacity}")
        else:
            length = min(max(length, 0), capacity)
        if not 0 <= leftpad <= length:
            raise ValueError(f"sequence {b}: cache_leftpad {leftpad} is outside [0, {length}]")
        end = length + seqlen_new

        def slots(positions):
            """Index into the cache storage for this sequence's positions."""
            if paged:
                return block_table[b].long()[positions // page_size], positions % page_size
            return torch.full_like(positions, rows[b]), positions

        q_b = q[b:b + 1]
        if appending:
            new = torch.arange(length, end, device=k_cache.device)
            k_new = k[b:b + 1]
            if rotary:
                q_pos = length + torch.arange(seqlen_q) if rows_by_position else torch.full((seqlen_q,), length)
                if max(end - 1, int(q_pos.max())) >= rotary_cos.shape[0]:
                    raise ValueError(f"sequence {b}: rotary tables of {rotary_cos.shape[0]} positions "
                                     f"do not reach position {max(end - 1, int(q_pos.max()))}")
                q_b = apply_rotary(q_b, rotary_cos, rotary_sin, q_pos[None], rotary_interleaved).to(q.dtype)
                k_new = apply_rotary(k_new, rotary_cos, rotary_sin, new[None].cpu(), rotary_interleaved)
            k_after[slots(new)] = k_new[0].to(k_after.dtype).to(k_after.device)
            v_after[slots(new)] = v[b].to(v_after.dtype).to(v_after.device)

        key_pos = torch.arange(leftpad, end, device=k_cache.device)
        keys = k_after[slots(key_pos)].float().to(q.device).repeat_interleave(group, dim=1)    # (n, hq, d)
        values = v_after[slots(key_pos)].float().to(q.device).repeat_interleave(group, dim=1)

        j = key_pos.to(q.device).view(1, -1)                                          # key positions
        diag = (end - seqlen_q + torch.arange(seqlen_q, device=q.device)).view(-1, 1)  # query positions
        visible = torch.ones(seqlen_q, key_pos.numel(), dtype=torch.bool, device=q.device)
        if right >= 0:
            visible &= j <= diag + right
        if left >= 0:
            visible &= j >= diag - left

        scores = torch.einsum("qhd,khd->hqk", q_b[0].float(), keys) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        if alibi_slopes is not None:
            scores = scores - slopes[b].view(-1, 1, 1) * (diag - j).abs().float()
        scores = scores.masked_fill(~visible, float("-inf"))
        lse_b = torch.logsumexp(scores, dim=-1)                                      # (hq, sq)
        probs = torch.where(visible, torch.exp(scores - lse_b.unsqueeze(-1)), torch.zeros(()))
        out[b] = torch.einsum("hqk,khd->qhd", probs, values)
        lse[b] = lse_b
    return out, lse, k_after, v_after

