"""flash_decode and plan: tensors turned into the Go core's call record (core.Tensors) and run
arguments. Python checks only what the record cannot say (Python types, None from 0); the core
checks the tensors and every value, names the argument at fault and plans."""

from __future__ import annotations

import ctypes
import inspect
import json
import math
import operator
import os
from typing import Any

import torch

from . import _native

_is_compiling = torch.compiler.is_compiling  # bound once: the hot path asks every call
_current_stream = _native.current_stream
_INT64 = 1 << 63

# The one cache: call signature -> [Run, handle, workspace bytes (the largest needed so far), device,
# lse shape, q contiguous, an int cache_seqlens, binding]. _last is its last hit (dict, key, entry):
# a loop over one layout compares its key instead of hashing it.
_prepared = {}
_last = (None, None, None)
_PREPARED_LIMIT = 4096


def _forget():
    """In a child forked from this process: no entry reaches the parent's Go runtime."""
    global _last
    _prepared.clear()
    _last = (None, None, None)


os.register_at_fork(after_in_child=_forget)


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                 rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                 cache_seqlens: int | torch.Tensor | None = None, cache_batch_idx: torch.Tensor | None = None,
                 cache_leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                 softmax_scale: float | None = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
                 num_splits: int = 0, return_softmax_lse: bool = False, out: torch.Tensor | None = None,
                 max_seqlen_k: int | None = None, batch_invariant: bool = False,
                 k_descale: float | torch.Tensor | None = None,
                 v_descale: float | torch.Tensor | None = None,
                 sinks: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                 max_seqlen_q: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few new query tokens over a KV cache (flash decoding).

    FlashAttention 2's ``flash_attn_with_kvcache``, same names and meanings. Runs on q's device's current
    stream with no host sync (CUDA-graph safe); with k and v the new tokens are first written into the cache.
    Under torch.compile it is the op ``flash_decode::decode`` (``decode_append`` with k and v). See docs/api.md.

    Args:
        q: ``(batch, seqlen_q <= 16, nheads_q, headdim)``, float16 or bfloat16.
        k_cache, v_cache: ``(batch_cache, seqlen_cache, nheads_kv, headdim)``, or with
            block_table pages ``(num_blocks, page_size, nheads_kv, headdim)``; q's dtype, or both
            float8_e4m3fn or both float8_e5m2.
        k, v: new tokens ``(batch, seqlen_new, nheads_kv, headdim)``, both or neither.
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)``, with k and v.
        cache_seqlens: keys per sequence before the new tokens: None (all), an int or int32 ``(batch,)``.
        cache_batch_idx, cache_leftpad: int32 ``(batch,)``: each sequence's cache row; its first key.
        block_table: int32 ``(batch, max_blocks)``: each sequence's pages.
        softmax_scale: scale of q.k; None: 1/sqrt(headdim).
        causal, window_size: row i sees keys up to its position; ``(left, right)`` of it (-1: unbounded).
        softcap: > 0 caps the scores at ``softcap * tanh(s / softcap)``.
        rotary_interleaved: GPT-J pairs (True) or GPT-NeoX halves (False).
        alibi_slopes: float32 ``(nheads_q,)`` or ``(batch, nheads_q)``.
        num_splits: 0 lets the planner choose (see :func:`plan`); n > 0 asks for n.
        return_softmax_lse: also return each row's natural-log LSE.
        out: a tensor of q's shape, dtype and device to write into.
        max_seqlen_k: with a cache_seqlens tensor, a bound on the keys a sequence attends, planned for.
        batch_invariant: a sequence's result bits depend only on its own inputs, never on the batch, the
            other lengths or the GPU (with num_splits=0; max_seqlen_k, if given, must bound every length).
        k_descale, v_descale: an fp8 cache's scales (an element x attends as x * descale; new tokens are
            stored as x / descale, saturated): None (1), a positive float, or float32 tensors on q's device,
            both, of 1 element or ``(batch, nheads_kv)`` (their values are not checked: no host sync).
        sinks: float32 ``(nheads_q,)``: a logit per query head whose ``exp`` joins each row's softmax
            denominator with no value (gpt-oss); the LSE includes it.
        cu_seqlens_q, max_seqlen_q: ragged query lengths (FlashAttention 3's): int32 ``(batch + 1,)`` on q's
            device, sequence b's rows being ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` (0 to 16 of them, causal
            and bottom-right aligned to their own count), and the int 1-16 the call is planned for (at least
            the most rows a sequence has). q and out are then ``(total_q, nheads_q, headdim)``, k and v
            ``(total_q, nheads_kv, headdim)``, lse ``(nheads_q, total_q)``. See docs/api.md.

    Returns:
        out in q's shape and dtype; with return_softmax_lse ``(out, lse)``, lse float32 (batch, nheads_q, seqlen_q),
        or (nheads_q, total_q) with cu_seqlens_q.

    Raises:
        TypeError, ValueError, NotImplementedError (a size the kernels lack) or RuntimeError (no driver, native
        failure, forked process), naming the argument; a refused call writes nothing.

    Example::

        >>> import torch, flash_decode
        >>> q = torch.randn(2, 1, 32, 128, dtype=torch.float16, device="cuda")
        >>> k, v = (torch.randn(2, 4096, 8, 128, dtype=torch.float16, device="cuda") for _ in "kv")
        >>> lens = torch.tensor([4096, 1000], dtype=torch.int32, device="cuda")
        >>> out, lse = flash_decode.flash_decode(q, k, v, cache_seqlens=lens, causal=True, return_softmax_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([2, 1, 32, 128]), torch.Size([2, 32, 1]))
    """
    if _is_compiling():  # named one by one: dynamo of torch 2.9 cannot trace locals()
        return _traced(q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                       cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                       block_table=block_table, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                       softcap=softcap, rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
                       num_splits=num_splits, return_softmax_lse=return_softmax_lse, out=out,
                       max_seqlen_k=max_seqlen_k, batch_invariant=batch_invariant, k_descale=k_descale,
                       v_descale=v_descale, sinks=sinks, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q)
    plain = (k is None and v is None and rotary_cos is None and rotary_sin is None and cache_batch_idx is None
             and cache_leftpad is None and block_table is None and alibi_slopes is None and softcap == 0.0
             and window_size == (-1, -1) and k_descale is None and v_descale is None
             and sinks is None)
    # The layout's key. Options go in with their types: as dict keys True == 1 and 2.0 == 2,
    # and every call must refuse what its first call would. An int cache_seqlens is "an int".
    global _last
    try:
        sig = (q.shape, q.stride(), q.dtype, q.get_device(), k_cache.shape, k_cache.stride(), k_cache.dtype,
               k_cache.get_device(), v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.get_device(),
               cache_seqlens if cache_seqlens is None else int if type(cache_seqlens) is int else
               (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.get_device()),
               type(softmax_scale), softmax_scale, type(causal), causal, type(num_splits), num_splits,
               type(batch_invariant), batch_invariant,
               None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()),
               None if cu_seqlens_q is None and max_seqlen_q is None else
               (_sig(cu_seqlens_q), type(max_seqlen_q), max_seqlen_q))
        if not plain:
            sig += (*map(_sig, (k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
                                alibi_slopes, sinks)), type(window_size), tuple(window_size), tuple(map(type, window_size)),
                    type(softcap), softcap, type(rotary_interleaved), rotary_interleaved, _scale_sig(k_descale),
                    _scale_sig(v_descale))
        last = _last
        if last[0] is _prepared and sig == last[1]:
            entry = last[2]
        elif (entry := _prepared.get(sig)) is not None:
            _last = (_prepared, sig, entry)
    except (AttributeError, TypeError):  # not tensors, or unhashable: _prepare's checks say which
        sig = entry = None
    if entry is None:  # the call's arguments only: no local of this function leaks into the record
        args = locals()
        entry = _prepare(sig, **{name: args[name] for name in _PARAMETERS})
    run, handle, workspace_bytes, device, lse_shape, q_contiguous, int_length, _ = entry
    seqlen, seqlens = -1, 0  # -1: the whole cache
    if int_length:
        seqlen = cache_seqlens
        if seqlen == -1 or max_seqlen_k is not None:
            _check_lengths(cache_seqlens, max_seqlen_k)
    elif cache_seqlens is not None:
        seqlens = cache_seqlens.data_ptr()
        if max_seqlen_k is not None:
            seqlen = max_seqlen_k
            if type(seqlen) is not int or seqlen == -1:
                _check_lengths(cache_seqlens, max_seqlen_k)
    elif max_seqlen_k is not None:
        _check_lengths(cache_seqlens, max_seqlen_k)
    if out is None:  # empty_like keeps a contiguous q's strides (those registered) and is the cheaper call
        out = torch.empty_like(q) if q_contiguous else torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(*lse_shape, dtype=torch.float32, device=q.device) if return_softmax_lse else None
    cu = 0 if cu_seqlens_q is None else cu_seqlens_q.data_ptr()
    stream = _current_stream(device)
    while True:
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device) if workspace_bytes else None
        try:
            if plain:
                status = run(handle, seqlen, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                             0 if lse is None else lse.data_ptr(), seqlens, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, cu,
                             0 if workspace is None else workspace.data_ptr(), workspace_bytes, stream)
            else:
                status = run(handle, seqlen, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                             0 if lse is None else lse.data_ptr(), seqlens,
                             0 if block_table is None else block_table.data_ptr(),
                             0 if cache_batch_idx is None else cache_batch_idx.data_ptr(),
                             0 if cache_leftpad is None else cache_leftpad.data_ptr(),
                             0 if alibi_slopes is None else alibi_slopes.data_ptr(),
                             0 if k is None else k.data_ptr(), 0 if v is None else v.data_ptr(),
                             0 if rotary_cos is None else rotary_cos.data_ptr(),
                             0 if rotary_sin is None else rotary_sin.data_ptr(),
                             k_descale.data_ptr() if isinstance(k_descale, torch.Tensor) else 0,
                             v_descale.data_ptr() if isinstance(v_descale, torch.Tensor) else 0,
                             0 if sinks is None else sinks.data_ptr(), cu,
                             0 if workspace is None else workspace.data_ptr(), workspace_bytes, stream)
        except OverflowError:  # past the core's int64
            name = "cache_seqlens" if type(cache_seqlens) is int else "max_seqlen_k"
            raise ValueError(f"{name}={seqlen} is out of range (a 64-bit int)") from None
        if status >= 0:
            return (out, lse) if return_softmax_lse else out
        workspace_bytes = _grown(entry, status, seqlen, workspace_bytes)


_PARAMETERS = tuple(inspect.signature(flash_decode).parameters)  # what a cache miss hands to _prepare


def _grown(entry, status, seqlen, given):
    """After Run refused a call: the larger workspace it needs (the layout's from now on), else Run's error."""
    native, handle = entry[7], entry[1]
    if (needed := native.Workspace(handle, seqlen)) < 0:
        raise _native.error(native, needed)
    if needed <= given:
        raise _native.error(native, status)
    entry[2] = max(entry[2], needed)
    return needed


def _sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


def _scale_sig(x):
    """A descale's part of the key: a tensor's layout, else the number (or None) with its type."""
    return _sig(x) if isinstance(x, torch.Tensor) else (type(x), x)


def _prepare(sig, q, cache_seqlens, **call):
    """Have the core check a call (flash_decode's arguments) and prepare its layout, and keep what later calls
    need under sig."""
    native, record = _call(q, cache_seqlens=cache_seqlens, **call)
    if _device(q) >= 0:  # a CUDA q's call runs: RuntimeError where the driver serves no GPU
        native = _native.binding()
    if (handle := native.PrepareTensors(ctypes.addressof(record), ctypes.sizeof(record))) < 0:
        raise _native.error(native, handle)
    lse_shape = (q.shape[1], q.shape[0]) if q.dim() == 3 else (q.shape[0], q.shape[2], q.shape[1])
    entry = [_native.function(native, "Run"), handle, 0, _device(q), lse_shape, q.is_contiguous(),
             type(cache_seqlens) is int, native]
    if sig is not None:
        if len(_prepared) >= _PREPARED_LIMIT:
            _prepared.clear()  # the core keeps the handles: preparing again is a lookup
        _prepared[sig] = entry
    return entry


def _call(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
          cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
          window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0, out=None,
          batch_invariant=False, k_descale=None, v_descale=None, sinks=None, cu_seqlens_q=None, max_seqlen_q=None,
          stage="eager", **_):
    """(binding, core.Tensors record) of a flash_decode call (the planning binding: a CPU q is refused by
    name, without a GPU). stage "trace" (torch.compile tracing flash_decode): Python's checks only, None;
    "fake" (an op's fake kernel): None where a size or an option is symbolic (checked when the op runs)."""
    arrays = {name: x if isinstance(x, torch.Tensor) else None for name, x in (
        ("cache_seqlens", cache_seqlens), ("k_descale", k_descale), ("v_descale", v_descale))}
    tensors = _descriptors(dict(
        q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        alibi_slopes=alibi_slopes, sinks=sinks, out=out, cu_seqlens_q=cu_seqlens_q, **arrays))
    if stage == "fake" and not all(isinstance(x, (int, float, type(None), torch.Tensor)) for x in (
            *tensors.values(), softmax_scale, softcap, *window_size, num_splits, max_seqlen_q, k_descale, v_descale,
            cache_seqlens)):
        return None
    options = _options(cache_seqlens, softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
                       batch_invariant, k_descale, v_descale, max_seqlen_q, rotary_cos is not None)
    if stage == "trace":
        return None
    native = _native.binding(planner_only=True)
    return native, _native.record(native, "Tensors", tensors, options)


def _descriptors(tensors, device=None):
    """The record's fields of the tensors given (by argument name; None: not given) on their devices (or
    device): Python refuses what is not a tensor, the core checks the rest."""
    fields = {}
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        fields.update(_native.desc(name, t.dtype, t.shape, t.stride(), _device(t) if device is None else device))
    return fields


def _device(t):
    """t's CUDA device index; -1 off CUDA."""
    return t.device.index if t.device.type == "cuda" else -1


def _options(cache_seqlens, softmax_scale, causal, window_size, softcap, rotary_interleaved, num_splits,
             batch_invariant, k_descale, v_descale, max_seqlen_q, rotary):
    """The record's options, after the checks only Python can make: types (True is not 1), None from 0."""
    if cache_seqlens is not None and type(cache_seqlens) is not int and not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be None, an int or an int32 tensor, got {type(cache_seqlens).__name__}")
    for name, flag in (("causal", causal), ("batch_invariant", batch_invariant)) + (
            (("rotary_interleaved", rotary_interleaved),) if rotary else ()):
        _check_bool(name, flag)
    scale = 0.0 if softmax_scale is None else _float("softmax_scale", softmax_scale, "a float or None")
    if scale == 0 and softmax_scale is not None:  # 0 is None to the core
        raise ValueError(f"softmax_scale={softmax_scale} must be positive (None: 1/sqrt(headdim))")
    left, right = _window(window_size)
    fields = dict(softmax_scale=scale, causal=int(causal), window_left=left, window_right=right,
                  softcap=_float("softcap", softcap), rotary_interleaved=int(rotary and rotary_interleaved),
                  num_splits=_check_int("num_splits", num_splits), batch_invariant=int(batch_invariant),
                  max_seqlen_q=0 if max_seqlen_q is None else _check_int("max_seqlen_q", max_seqlen_q))
    for name, x in (("k_descale", k_descale), ("v_descale", v_descale)):
        if x is not None and not isinstance(x, torch.Tensor):  # a tensor is a descriptor
            fields[name + "_value"] = _float(name, x, "a float or a float32 tensor")
            if fields[name + "_value"] == 0:  # 0 is 1 to the core
                raise ValueError(f"{name}={x} must be positive (None: 1)")
    return fields


def _layout(native, record):
    """The core.Layout record of a core.Tensors record, which the core checks (but q's device)."""
    layout = ctypes.create_string_buffer(len(native.LayoutFields().split(",")) * 8)
    if (status := native.TensorsLayout(ctypes.addressof(record), ctypes.sizeof(record), ctypes.addressof(layout),
                                       ctypes.sizeof(layout))) < 0:
        raise _native.error(native, status)
    return layout


def _prepare_on(native, record, device):
    """The handle of a core.Tensors record's layout prepared on device (-1: planning, without a GPU)."""
    layout = _layout(native, record)
    if (handle := native.Prepare(ctypes.addressof(layout), ctypes.sizeof(layout), device)) < 0:
        raise _native.error(native, handle)
    return handle


def _checked(*args, **kwargs):
    """flash_decode's checks of a traced call (the ops' fake kernels), through the core but for q's device."""
    if (call := _call(*args, **kwargs, stage="fake")) is not None:
        _layout(*call)


def _traced(q, k_cache, v_cache, k, v, *, rotary_cos, rotary_sin, cache_seqlens, window_size, rotary_interleaved,
            return_softmax_lse, out, max_seqlen_k, k_descale, v_descale, **options):
    """flash_decode while torch.compile traces: the checks only Python makes (the ops' schemas would turn
    True into 1; the fake kernels have the core check the tensors), out= (a copy here, which would cast
    or broadcast) against q, then an op. A descale goes in as a tensor or as a value (the schemas have
    no union)."""
    _call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, window_size=window_size, out=out,
          rotary_interleaved=rotary_interleaved, k_descale=k_descale, v_descale=v_descale, stage="trace", **options)
    _check_lengths(cache_seqlens, max_seqlen_k)
    for what, want, got in () if out is None else (("dtype", q.dtype, out.dtype), ("shape", q.shape, out.shape),
                                                    ("device", q.device, out.device)):
        if got != want:
            raise (TypeError if what == "dtype" else ValueError)(f"out must have q's {what} {want}, got {got}")
    seqlens, seqlen = (None, cache_seqlens) if type(cache_seqlens) is int else (cache_seqlens, None)
    left, right = window_size
    descales = {name + ("" if isinstance(x, torch.Tensor) else "_value"): x
                for name, x in (("k_descale", k_descale), ("v_descale", v_descale))}
    appended = {} if k is None and rotary_cos is None else dict(
        k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved)
    result, lse = (torch.ops.flash_decode.decode_append if appended else torch.ops.flash_decode.decode)(
        q, k_cache, v_cache, cache_seqlens=seqlens, seqlen=seqlen, window_left=left, window_right=right,
        max_seqlen_k=max_seqlen_k, **descales, **appended, **options)
    if out is not None:
        result = out.copy_(result)
    return (result, lse) if return_softmax_lse else result


def plan(batch: int, seqlen_q: int, nheads_q: int, nheads_kv: int, headdim: int, seqlen_cache: int, *,
         dtype: torch.dtype = torch.float16, num_splits: int = 0, device: int | str | torch.device | None = None,
         seqlen: int | None = None, serving: bool = False, seqlen_new: int = 0,
         window_size: tuple[int, int] = (-1, -1), rotary: bool = False, page_size: int = 0,
         lengths: bool = False, batch_invariant: bool = False, kv_dtype: torch.dtype | None = None,
         k_descale: float | torch.Tensor | None = None,
         v_descale: float | torch.Tensor | None = None,
         cu_seqlens_q: torch.Tensor | None = None) -> dict[str, Any]:
    """What :func:`flash_decode` would launch for these shapes on a device, from the Go
    core: the split count num_splits=0 picks, the grid, the kernels and the workspace.
    The full reference is docs/api.md.

    Args:
        batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache: q's and the caches' shapes.
        dtype: torch.float16 or torch.bfloat16.
        num_splits: as in :func:`flash_decode` (0: the planner chooses).
        device: a CUDA device; None: the current one; -1: a default H200-like device, no GPU needed.
        seqlen: an int cache_seqlens (None: the whole cache); with lengths, max_seqlen_k.
        serving: plan the serving kernels, as a call with any serving argument runs.
        seqlen_new: the tokens a call appends (k.shape[1]).
        window_size: as in :func:`flash_decode`.
        rotary: rotary tables given (with seqlen_new).
        page_size: > 0: a paged cache of pages of that many keys.
        lengths: the call passes a cache_seqlens tensor.
        batch_invariant: as in :func:`flash_decode` (the plan then has ``invariant_tiles``).
        kv_dtype: the caches' dtype: None (dtype's), torch.float8_e4m3fn or torch.float8_e5m2.
        k_descale, v_descale: as in :func:`flash_decode` (a tensor's shape and strides are read, not its data).
        cu_seqlens_q: ragged query lengths, int32 ``(batch + 1,)`` (its shape is read, not its data): seqlen_q
            is then max_seqlen_q, and the plan is the uniform one of that many rows a sequence.

    Returns:
        dict: the core's plan (``num_splits``, ``grid``, ``cluster``, ``workspace_bytes``, ``kernel``, ...).

    Example (on an H200)::

        >>> import torch, flash_decode
        >>> p = flash_decode.plan(1, 1, 32, 8, 128, 32768)
        >>> p["num_splits"], p["grid"], p["cluster"], p["workspace_bytes"], p["combine"]  # doctest: +SKIP
        (16, [16, 8, 1], 1, 264192, 'fd_combine_f16')
    """
    sizes = {name: _check_int(name, value) for name, value in (
        ("batch", batch), ("seqlen_q", seqlen_q), ("nheads_q", nheads_q), ("nheads_kv", nheads_kv),
        ("headdim", headdim), ("seqlen_cache", seqlen_cache), ("seqlen_new", seqlen_new), ("page_size", page_size))}
    if seqlen is not None and _check_int("seqlen", seqlen) < 0:  # to the core, -1 is the whole cache
        raise ValueError(f"seqlen={seqlen} must not be negative (None: the whole cache)")
    for name, flag in (("serving", serving), ("rotary", rotary), ("lengths", lengths)):
        _check_bool(name, flag)
    index = _device_index(device)
    native = _native.binding(planner_only=index is None or index < 0)  # device -1 plans without a GPU or driver
    # The call of contiguous tensors of these shapes (of a tensor argument, its shape and strides), from the core.
    tensors = _descriptors(dict(cu_seqlens_q=cu_seqlens_q, **{
        name: x for name, x in (("k_descale", k_descale), ("v_descale", v_descale)) if isinstance(x, torch.Tensor)}),
        device=-1)
    record = _native.record(native, "Tensors", tensors, _options(
        None, None, False, window_size, 0.0, True, num_splits, batch_invariant, k_descale, v_descale,
        seqlen_q if cu_seqlens_q is not None else None, rotary))
    shapes = _native.record(native, "Shapes", sizes, dict(dtype=_native.code(dtype), kv_dtype=_native.code(kv_dtype),
                                                          rotary=rotary, lengths=lengths, serving=serving))
    if (status := native.DescribeShapes(ctypes.addressof(shapes), ctypes.sizeof(shapes), ctypes.addressof(record),
                                        ctypes.sizeof(record))) < 0:
        raise _native.error(native, status)
    if index is None:  # torch's own error would not name the way out
        raise RuntimeError(f"plan(device={device!r}) plans for the current CUDA device, and torch sees none; "
                           "device=-1 plans for a default H200-like device (132 SMs) without a GPU")
    handle = _prepare_on(native, record, index)
    if seqlen is None:  # the whole cache: with an int length and new tokens, the cache they fill
        pages = -(-seqlen_cache // page_size) if page_size > 0 else 0
        seqlen = -1 if lengths or not seqlen_new else max(0, (pages * page_size or seqlen_cache) - seqlen_new)
    try:
        if (status := native.Workspace(handle, seqlen)) < 0:
            raise _native.error(native, status)
        result = json.loads(native.PlanJSON(handle, seqlen))
    finally:
        native.Release(handle)
    result.setdefault("kernel", result["variant"]["kernel"])
    return result


def _device_index(device):
    """plan()'s device as an index (-1: the default H200-like device; None: the current one, which torch
    does not see)."""
    if device is not None and (isinstance(device, bool) or not isinstance(device, (int, str, torch.device))):
        raise TypeError(f"device must be an int, a str or a torch.device, got {type(device).__name__}")
    if isinstance(device, int) and device < -1:
        raise ValueError(f"device={device} must be a CUDA device index, or -1 for the default device")
    if isinstance(device, (str, torch.device)) and (device := torch.device(device)).type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    index = device if isinstance(device, int) else getattr(device, "index", None)
    return torch.cuda.current_device() if index is None and torch.cuda.is_available() else index


# ---- checks only Python can make ----

def _check_lengths(cache_seqlens, max_seqlen_k):
    """Refuse lengths the core cannot be told: -1 (its whole cache), past int64, a max_seqlen_k without a
    cache_seqlens tensor."""
    if type(cache_seqlens) is int and cache_seqlens == -1:
        raise ValueError("cache_seqlens=-1 must not be negative (None: the whole cache)")
    if max_seqlen_k is not None:
        if type(max_seqlen_k) is not int:
            raise TypeError(f"max_seqlen_k must be an int, got {type(max_seqlen_k).__name__}")
        _check_int("max_seqlen_k", max_seqlen_k)  # past the core's int64
        if not isinstance(cache_seqlens, torch.Tensor):
            raise ValueError("max_seqlen_k is for a cache_seqlens tensor: an int cache_seqlens is planned by itself"
                             if cache_seqlens is not None else "max_seqlen_k needs cache_seqlens as a tensor: "
                             "without it every sequence attends the whole cache")
        if max_seqlen_k == -1:
            raise ValueError("max_seqlen_k=-1 must not be negative")


def _window(window_size):
    """window_size as two ints (left, right)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        error = ValueError if isinstance(window_size, (tuple, list)) else TypeError
        raise error(f"window_size must be a tuple of two ints (left, right), got {window_size!r}")
    return [_check_int("window_size", w) for w in window_size]


def _check_bool(name, value):
    """TypeError unless value is a bool (1 is not one, though 1 == True)."""
    if type(value) is not bool:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_int(name, value):
    """value as an int: TypeError for bools, floats and non-numbers, ValueError past the core's int64."""
    # No try/except: torch.compile's tracer of torch 2.11 passes on operator.index's own error.
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not -_INT64 <= (value := operator.index(value)) < _INT64:
        raise ValueError(f"{name}={value} is out of range (a 64-bit int)")
    return value


def _float(name, value, what="a float"):
    """value as a float (an int past float64 as infinity, which the core refuses); what: the types taken."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        return math.inf
