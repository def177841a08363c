"""The custom ops torch.compile puts in the graph: ``flash_decode::decode``, ``decode_append``
(writes k and v into the caches, declared mutated) and ``merge_states`` (of stacked states), each
returning fresh ``(out, lse)``; the CUDA kernels are the eager calls, the fake ones give shapes."""

import inspect
from typing import Optional

import torch
from torch import Tensor

from . import _api, _merge


def _decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor], seqlen: Optional[int],
            cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
            softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
            alibi_slopes: Optional[Tensor], num_splits: int, max_seqlen_k: Optional[int] = None,
            batch_invariant: bool = False, k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
            k_descale_value: Optional[float] = None, v_descale_value: Optional[float] = None,
            sinks: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
            max_seqlen_q: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """flash_decode without new tokens; returns (out, lse). A descale is a tensor or a value (*_value)."""
    return _joined(_api.flash_decode, **locals())


def _decode_append(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                   rotary_cos: Optional[Tensor], rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                   seqlen: Optional[int], cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                   block_table: Optional[Tensor], softmax_scale: Optional[float], causal: bool, window_left: int,
                   window_right: int, softcap: float, rotary_interleaved: bool, alibi_slopes: Optional[Tensor],
                   num_splits: int, max_seqlen_k: Optional[int] = None, batch_invariant: bool = False,
                   k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
                   k_descale_value: Optional[float] = None, v_descale_value: Optional[float] = None,
                   sinks: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                   max_seqlen_q: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """flash_decode appending k and v into the caches; returns (out, lse). Descales as in decode."""
    return _joined(_api.flash_decode, **locals())


decode = torch.library.custom_op("flash_decode::decode", _decode, mutates_args=(), device_types="cuda")
decode_append = torch.library.custom_op("flash_decode::decode_append", _decode_append,
                                        mutates_args=("k_cache", "v_cache"), device_types="cuda")


def _joined(call, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True, *,
            cache_seqlens, seqlen, window_left, window_right, k_descale, v_descale, k_descale_value, v_descale_value,
            **options):
    """call (flash_decode's signature: eager, flash_decode; traced, its checks) of an op's parameters, the
    schemas' split arguments joined."""
    return call(
        q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        cache_seqlens=seqlen if cache_seqlens is None else cache_seqlens, window_size=(window_left, window_right),
        k_descale=k_descale_value if k_descale is None else k_descale, return_softmax_lse=True,
        v_descale=v_descale_value if v_descale is None else v_descale, **options)


@torch.library.custom_op("flash_decode::merge_states", mutates_args=(), device_types="cuda")
def merge_states(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """merge_states of stacked states (num_states, *rows, headdim) and LSEs (num_states, *rows)."""
    return _merge.merge_states(outs, lses)


def _fake(fn):
    """The fake kernel of op fn: flash_decode's checks of the tensors (through the core), then _results."""
    signature = inspect.signature(fn)

    def fake(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        _joined(_api._checked, **bound.arguments)
        return _results(bound.arguments["q"])
    return fake


def _results(q, *_):
    """Empty (out, lse) as the kernels return them: out like q, contiguous; lse float32 (batch, nheads_q,
    seqlen_q), or (nheads_q, total_q) for a ragged q (total_q, nheads_q, headdim)."""
    if q.dim() == 3:
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    batch, seqlen_q, nheads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads_q, seqlen_q), dtype=torch.float32)


decode.register_fake(_fake(_decode))
decode_append.register_fake(_fake(_decode_append))
@merge_states.register_fake
def _(outs, lses):
    _merge._checked(outs, lses)
    return outs.new_empty(outs.shape[1:]), outs.new_empty(outs.shape[1:-1], dtype=torch.float32)
