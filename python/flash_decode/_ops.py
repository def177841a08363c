"""flash_decode as torch custom ops, for torch.compile.

While torch.compile traces, :func:`flash_decode.flash_decode` calls
:func:`traced`, which puts one of two ops into the graph:

- ``flash_decode::decode``: attention only; writes nothing it is given.
- ``flash_decode::decode_append``: with k and v (and rotary): writes the new
  tokens into k_cache and v_cache (declared as mutated), then attends.

Both return ``(out, lse)``, fresh contiguous tensors; their CUDA kernels run
the eager path, and their fake kernels give the shapes and dtypes the
compiler traces with. Eager calls never come through here. So does
``flash_decode::merge_states`` for :func:`flash_decode.merge_states` (and
merge_state) of stacked states. Every optional
argument of flash_decode maps onto the op schema: tensors as ``Tensor?``, an
int cache_seqlens as ``seqlen`` (``int?``), window_size as two ints,
max_seqlen_k as ``int?``.
"""

from typing import Optional

import torch
from torch import Tensor

from . import _api


@torch.library.custom_op("flash_decode::decode", mutates_args=(), device_types="cuda")
def decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor], seqlen: Optional[int],
           cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
           softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
           alibi_slopes: Optional[Tensor], num_splits: int, max_seqlen_k: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """flash_decode without new tokens; returns (out, lse)."""
    return _api.flash_decode(
        q, k_cache, v_cache, cache_seqlens=seqlen if cache_seqlens is None else cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right), softcap=softcap,
        alibi_slopes=alibi_slopes, num_splits=num_splits, return_softmax_lse=True, max_seqlen_k=max_seqlen_k)


@torch.library.custom_op("flash_decode::decode_append", mutates_args=("k_cache", "v_cache"), device_types="cuda")
def decode_append(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                  rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                  seqlen: Optional[int], cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                  block_table: Optional[Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
                  window_right: int, softcap: float, rotary_interleaved: bool, alibi_slopes: Optional[Tensor],
                  num_splits: int, max_seqlen_k: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """flash_decode appending k and v into the caches; returns (out, lse)."""
    return _api.flash_decode(
        q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        cache_seqlens=seqlen if cache_seqlens is None else cache_seqlens, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, block_table=block_table, softmax_scale=softmax_scale, causal=causal,
        window_size=(window_left, window_right), softcap=softcap, rotary_interleaved=rotary_interleaved,
        alibi_slopes=alibi_slopes, num_splits=num_splits, return_softmax_lse=True, max_seqlen_k=max_seqlen_k)


@torch.library.custom_op("flash_decode::merge_states", mutates_args=(), device_types="cuda")
def merge_states(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """merge_states of stacked states (num_states, *rows, headdim) and their
    LSEs (num_states, *rows); returns (out, lse)."""
    from . import _merge  # (it imports this module)
    return _merge._merge(outs, lses, None, None)


@merge_states.register_fake
def _merge_states_fake(outs, lses):
    return outs.new_empty(outs.shape[1:]), outs.new_empty(outs.shape[1:-1], dtype=torch.float32)


def _results(q):
    """Empty (out, lse) as the kernels return them: out contiguous in q's
    shape and dtype, lse float32 (batch, nheads_q, seqlen_q)."""
    batch, seqlen_q, nheads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads_q, seqlen_q), dtype=torch.float32)


@decode.register_fake
def _decode_fake(q, *_):
    return _results(q)


@decode_append.register_fake
def _decode_append_fake(q, *_):
    return _results(q)


def traced(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
           block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
           num_splits, return_softmax_lse, out, max_seqlen_k=None):
    """flash_decode's arguments as one of the two ops (what torch.compile
    traces). The arguments are checked here, at trace time, as an eager call
    checks them before its first launch: the ops' schemas would convert True
    to 1 (or 1.0) and a wrong type or rank would fail inside the fake kernel
    with the compiler's error, and out= is a copy of the op's result into
    out, which would cast or broadcast. The ops' kernels check the rest
    (values, devices) when the graph runs."""
    _api._serving_layout(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                         rotary_interleaved, alibi_slopes, num_splits, out)
    _api._check_seqlen_q(q.shape[1])
    _api._check_bound(max_seqlen_k, cache_seqlens)
    if out is not None and out.device != q.device:
        raise ValueError(f"out must be on q's device {q.device}, got {out.device}")
    seqlens, seqlen = (None, cache_seqlens) if type(cache_seqlens) is int else (cache_seqlens, None)
    window_left, window_right = window_size
    if k is None and v is None and rotary_cos is None and rotary_sin is None:
        result, lse = torch.ops.flash_decode.decode(
            q, k_cache, v_cache, seqlens, seqlen, cache_batch_idx, cache_leftpad, block_table, softmax_scale,
            causal, window_left, window_right, softcap, alibi_slopes, num_splits, max_seqlen_k)
    else:
        result, lse = torch.ops.flash_decode.decode_append(
            q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, seqlens, seqlen, cache_batch_idx, cache_leftpad,
            block_table, softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved,
            alibi_slopes, num_splits, max_seqlen_k)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_softmax_lse else result
