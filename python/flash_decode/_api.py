"""The torch layer: the checks only Python can make (types, ranks, that the
tensors agree in shape, which arguments go together, devices), allocation of
out / LSE / workspace, the stream handle, then one call into the Go core,
which checks every value (sizes, strides, options) and names the argument at
fault. A plain call runs through Prepare / Run; one with any serving argument
(new tokens, rotary, a block table, cache_batch_idx, cache_leftpad, a window,
softcap, ALiBi) through PrepareServing, which takes the layout as JSON, and
RunServing. Under torch.compile the call is a custom op (see _ops)."""

from __future__ import annotations

import json
import math
import operator
import re
from typing import Any, Literal, overload

import torch

from . import _native, _ops

# Bound once: the eager hot path asks on every call whether it is being traced.
_is_compiling = torch.compiler.is_compiling

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2}  # core.DType
MAX_SEQLEN_Q = 16  # core.MaxSeqlenQ: more query tokens per sequence is prefill

# Layouts seen before (see flash_decode): call signature -> what _prepare or
# _prepare_serving returns.
_prepared = {}
_PREPARED_LIMIT = 4096
# The last layout found in _prepared: (that dict, the key, its entry). A loop
# over one layout compares its key with this one, as the dict would after
# hashing it, and skips the hash.
_last = (None, None, None)
# Per layout with an int cache_seqlens: workspace bytes by length (the planner
# sizes the splits by it), at most this many lengths.
_WORKSPACES_LIMIT = 1024
# Ints go to the Go core as int64: larger ones are refused by name, not by gopy's conversion.
_INT64 = 1 << 63

_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device):
    """The CUstream handle of torch's current stream on device (an index)."""
    return torch.cuda.current_stream(device).cuda_stream


if _get_raw_stream is not None:
    _current_stream = _get_raw_stream  # noqa: F811  (torch's C function itself: no Python frame a call)


# The return type follows return_softmax_lse: out, or (out, lse).
@overload
def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                 rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                 cache_seqlens: int | torch.Tensor | None = None, cache_batch_idx: torch.Tensor | None = None,
                 cache_leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                 softmax_scale: float | None = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
                 num_splits: int = 0, return_softmax_lse: Literal[False] = False,
                 out: torch.Tensor | None = None, max_seqlen_k: int | None = None) -> torch.Tensor: ...


@overload
def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                 rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                 cache_seqlens: int | torch.Tensor | None = None, cache_batch_idx: torch.Tensor | None = None,
                 cache_leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                 softmax_scale: float | None = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
                 num_splits: int = 0, return_softmax_lse: Literal[True],
                 out: torch.Tensor | None = None, max_seqlen_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                 rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                 cache_seqlens: int | torch.Tensor | None = None, cache_batch_idx: torch.Tensor | None = None,
                 cache_leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                 softmax_scale: float | None = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
                 num_splits: int = 0, return_softmax_lse: bool = False, out: torch.Tensor | None = None,
                 max_seqlen_k: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few new query tokens over a KV cache (flash decoding).

    The arguments are FlashAttention 2's ``flash_attn_with_kvcache``, with the
    same names and meanings: switching a call to this function is a rename.
    Runs in two stages on ``torch.cuda.current_stream()`` of q's device: a
    split-KV kernel spreads each sequence's keys over all SMs, then the
    per-split partial outputs are merged by their log-sum-exp: inside the
    same kernel when the splits of a sequence fit one thread-block cluster
    (up to 16 on H100/H200), else by a combine kernel. With ``k`` and ``v`` a
    kernel first writes the new tokens into the cache. There is no
    host/device synchronization, and the call can be captured in a CUDA
    graph: launch shapes depend on tensor shapes only, so a replay after new
    values are written into ``cache_seqlens`` (or the block table, or the
    new tokens) gives the right answer. The first call with a new layout
    (shapes, strides, dtypes, devices, options) checks it; later calls with
    the same layout only pass the new addresses (and an int
    ``cache_seqlens``, which is not part of the layout). Under
    ``torch.compile`` the call is the custom op ``flash_decode::decode`` (or
    ``flash_decode::decode_append`` with k and v), with no graph break.

    All positions are key indices of the sequence's cache. Sequence b
    attends keys ``[cache_leftpad[b], len)`` with ``len = cache_seqlens[b] +
    seqlen_new``; query row i sits at position ``len - seqlen_q + i``
    (bottom-right aligned), which the causal mask and the window count from.

    Args:
        q: ``(batch, seqlen_q, nheads_q, headdim)``, float16 or bfloat16, with
            1 <= seqlen_q <= 16 (more query tokens is prefill's work).
        k_cache, v_cache: ``(batch_cache, seqlen_cache, nheads_kv, headdim)``
            (batch_cache = batch unless ``cache_batch_idx`` is given), or
            with ``block_table`` a paged cache ``(num_blocks, page_size,
            nheads_kv, headdim)`` of any page_size >= 1; q's dtype and
            device; nheads_q must be a multiple of nheads_kv (MHA, GQA, MQA).
            headdim: 64, 128 and 256, and any other multiple of 8 up to 256;
            seqlen_cache: 0 to 2**30; batch * nheads_q * seqlen_q below
            2**31. Every tensor needs a contiguous last dimension; other
            strides are free (a cache may be a slice of a larger buffer).
        k, v: new tokens ``(batch, seqlen_new, nheads_kv, headdim)`` in q's
            dtype, both or neither: token t of sequence b is written into the
            cache at key ``cache_seqlens[b] + t`` (writes past the cache are
            skipped; an int cache_seqlens plus seqlen_new must not exceed
            seqlen_cache) before attention, which then sees them. cache_seqlens
            itself is not changed: the caller advances it. Needs
            cache_seqlens.
        rotary_cos, rotary_sin: ``(seqlen_ro, rotary_dim / 2)`` in q's dtype,
            both or neither, only with k and v: the first rotary_dim (even,
            at most headdim) channels of the new keys (at their positions)
            and of q are rotated. q's rows are rotated at ``cache_seqlens[b]
            + i`` when causal or a window is set, else all at
            ``cache_seqlens[b]``. Positions past seqlen_ro are clamped.
        cache_seqlens: valid keys per sequence before the new tokens: None
            (the whole cache), an int in [0, seqlen_cache], or an int32
            tensor ``(batch,)`` whose values the kernels clamp to [0,
            seqlen_cache].
        cache_batch_idx: int32 ``(batch,)``: sequence b uses row
            ``cache_batch_idx[b]`` of k_cache / v_cache (clamped to the
            cache's rows). Not with block_table.
        cache_leftpad: int32 ``(batch,)``: sequence b's keys start at
            ``cache_leftpad[b]``; those before are not attended.
        block_table: int32 ``(batch, max_blocks)``: key j of sequence b is
            row ``j % page_size`` of block ``block_table[b, j // page_size]``;
            seqlen_cache is ``max_blocks * page_size``. Block ids outside
            ``[0, num_blocks)`` are clamped on read and skipped on write.
        softmax_scale: scale of q.k before the softmax, a positive normal
            float32 (about 1.2e-38 to 3.4e38); None: 1/sqrt(headdim).
        causal: a bool; query row i sees keys up to its own position.
        window_size: ``(left, right)`` ints: row i at position p sees keys
            ``[p - left, p + right]``; -1 leaves a side unbounded. causal
            sets right to 0.
        softcap: a float; > 0 caps the scores: ``softcap * tanh(s /
            softcap)``; 0 turns it off.
        rotary_interleaved: a bool: rotate channel pairs (2m, 2m + 1)
            (GPT-J); False: pairs (m, m + rotary_dim / 2) (GPT-NeoX).
        alibi_slopes: float32 ``(nheads_q,)`` or ``(batch, nheads_q)``: adds
            ``-slope * |p - j|`` to the score of row position p and key j,
            after the softcap.
        num_splits: 0 lets the Go core's planner choose (see :func:`plan`);
            n > 0 asks for n, clamped to [1, min(cap, key tiles of the cache)].
        return_softmax_lse: also return the natural-log LSE of each row.
        out: optional tensor of q's shape, dtype and device to write into;
            it must not share memory with any input.
        max_seqlen_k: with a cache_seqlens tensor, an int bound the caller
            knows on the keys a sequence attends (its cache_seqlens plus the
            appended tokens), e.g. the longest sequence of the batch. The
            split is then planned for it, rounded up to a power of two,
            instead of for the cache's capacity: a cache allocated for 128K
            tokens that holds 1K runs the 1K plan. Each sequence is still
            split by its own length on the GPU, so any bound gives the right
            answer; one below the real lengths only costs speed. Not with an
            int cache_seqlens, which is planned by itself.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads_q, headdim)`` in q's dtype, and with
        return_softmax_lse, ``(out, lse)`` where lse is float32
        ``(batch, nheads_q, seqlen_q)``. A row that sees no key gives out = 0
        and lse = -inf.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: wrong rank, shape, device, stride or value, arguments
            that do not go together (k without v, rotary without k,
            cache_batch_idx with block_table), or out sharing memory with an
            input; the message names the argument. A refused call writes
            nothing into the caches.
        NotImplementedError: a size or stride the kernels do not support
            (such as headdim 100 or seqlen_q > 16); the message says what is.
        RuntimeError: no usable CUDA driver, or a failure in the native code.

    Example::

        >>> import torch, flash_decode
        >>> q = torch.randn(2, 1, 32, 128, dtype=torch.float16, device="cuda")
        >>> k = torch.randn(2, 4096, 8, 128, dtype=torch.float16, device="cuda")
        >>> v = torch.randn_like(k)
        >>> lens = torch.tensor([4096, 1000], dtype=torch.int32, device="cuda")
        >>> out, lse = flash_decode.flash_decode(q, k, v, cache_seqlens=lens,
        ...                                      causal=True, return_softmax_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([2, 1, 32, 128]), torch.Size([2, 32, 1]))
    """
    if _is_compiling():
        return _ops.traced(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                           cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                           rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, out, max_seqlen_k)
    # Any serving argument away from its default takes the serving path, whose
    # layout key extends the plain one; the plain path does only the plain
    # work. (An if, not an expression: CPython tests `is None` fastest there,
    # and a float softcap against 0.0 faster than against 0.)
    if (k is None and v is None and rotary_cos is None and rotary_sin is None and cache_batch_idx is None
            and cache_leftpad is None and block_table is None and alibi_slopes is None
            and softcap == 0.0 and window_size == (-1, -1)):
        serving = False
    else:
        serving = True
    # The hot path: a call whose layout (shapes, strides, dtypes, devices and
    # options) was seen before skips the checks; the Go core checks the new
    # addresses and launches. Option values go in with their types: as dict
    # keys True == 1 and 2.0 == 2, and every call must refuse what the first
    # call with that value would. An int cache_seqlens counts as "an int".
    global _last
    try:
        # get_device(): the CUDA ordinal, -1 off the GPU (never in a cached layout).
        sig = (q.shape, q.stride(), q.dtype, q.get_device(),
               k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.get_device(),
               v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.get_device(),
               cache_seqlens if cache_seqlens is None else int if type(cache_seqlens) is int else
               (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.get_device()),
               type(softmax_scale), softmax_scale, type(causal), causal, type(num_splits), num_splits,
               None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()))
        if serving:
            sig += _serving_sig(k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
                                window_size, softcap, rotary_interleaved, alibi_slopes)
        last = _last
        if last[0] is _prepared and sig == last[1]:
            entry = last[2]
        else:
            entry = _prepared.get(sig)
            if entry is not None:
                _last = (_prepared, sig, entry)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks will say
        sig = entry = None
    if entry is None:
        if serving:
            entry = _prepare_serving(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                     cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                                     window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, out)
        else:
            entry = _prepare(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, num_splits, out)
        if sig is not None:
            if len(_prepared) >= _PREPARED_LIMIT:
                _prepared.clear()  # the Go core keeps its handles: asking again is cheap
            _prepared[sig] = entry
    run, handle, workspace_bytes, workspaces, device, lse_shape, q_contiguous, workspace_fn, hints = entry

    seqlen, seqlens = -1, 0
    if workspaces is not None:  # an int cache_seqlens
        if max_seqlen_k is not None:
            _check_bound(max_seqlen_k, cache_seqlens)
        seqlen = cache_seqlens
        if seqlen < 0:  # never looked up: the core reads a negative length as "the whole cache"
            _check_length("cache_seqlens", seqlen)
        # Lengths whose keys (the appended ones too) round up to one multiple
        # of hints[3] keys plan alike (core.Shape.PlanKey): one size for them.
        block = (seqlen + hints[2] + hints[3] - 1) // hints[3]
        workspace_bytes = workspaces.get(block)
        if workspace_bytes is None:
            workspace_bytes = _workspace(workspace_fn, handle, workspaces, seqlen, block)
    elif cache_seqlens is not None:
        seqlens = cache_seqlens.data_ptr()
        if max_seqlen_k is not None:
            if type(max_seqlen_k) is not int:  # every call: as dict keys True == 1
                _check_bound(max_seqlen_k, cache_seqlens)
            # Bounds plan by their power of two (_bound_seqlen), so they are kept
            # by its exponent (_bound_key, inlined): a bound growing a token a
            # step asks the core once a doubling. 0 and a negative bound go to
            # _hint each call.
            hinted = hints[0].get((max_seqlen_k - 1).bit_length()) if max_seqlen_k > 0 else None
            if hinted is None:
                hinted = _hint(max_seqlen_k, hints, workspace_fn, handle)
            seqlen, workspace_bytes = hinted
    elif max_seqlen_k is not None:
        _check_bound(max_seqlen_k, cache_seqlens)
    if out is None:
        # A plain empty_like keeps q's strides when q is contiguous: the ones
        # the layout was registered with, but maybe on a dimension of size 1,
        # whose stride never moves an address. It is 0.2 us cheaper than
        # asking for a memory format.
        out = torch.empty_like(q) if q_contiguous else torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = None
    if return_softmax_lse:
        # The sizes as separate ints: torch parses them 0.5 us faster than a tuple.
        lse = torch.empty(*lse_shape, dtype=torch.float32, device=q.device)
    workspace = None
    if workspace_bytes:
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device)
    stream = _current_stream(device)
    try:
        if serving:
            run(handle, seqlen, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                0 if lse is None else lse.data_ptr(), seqlens,
                0 if block_table is None else block_table.data_ptr(),
                0 if cache_batch_idx is None else cache_batch_idx.data_ptr(),
                0 if cache_leftpad is None else cache_leftpad.data_ptr(),
                0 if alibi_slopes is None else alibi_slopes.data_ptr(),
                0 if k is None else k.data_ptr(), 0 if v is None else v.data_ptr(),
                0 if rotary_cos is None else rotary_cos.data_ptr(),
                0 if rotary_sin is None else rotary_sin.data_ptr(),
                0 if workspace is None else workspace.data_ptr(), workspace_bytes, stream)
        else:
            run(handle, seqlen, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                0 if lse is None else lse.data_ptr(), seqlens,
                0 if workspace is None else workspace.data_ptr(), workspace_bytes, stream)
    except Exception as err:
        raise _translate(err) from None
    return (out, lse) if return_softmax_lse else out


def _serving_sig(k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, block_table,
                 window_size, softcap, rotary_interleaved, alibi_slopes):
    """The part of a serving call's layout key that the plain key lacks
    (options with their types, as there). Raises AttributeError or TypeError
    for what is not a tensor or not a sequence: the checks then say what."""
    return (_tensor_sig(k), _tensor_sig(v), _tensor_sig(rotary_cos), _tensor_sig(rotary_sin),
            _tensor_sig(cache_batch_idx), _tensor_sig(cache_leftpad), _tensor_sig(block_table),
            _tensor_sig(alibi_slopes), type(window_size), tuple(window_size), tuple(map(type, window_size)),
            type(softcap), softcap, type(rotary_interleaved), rotary_interleaved)


def _tensor_sig(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


def _prepare(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, num_splits, out):
    """Check what only Python can, register the layout with the Go core
    (which checks the rest), and return what the hot path needs: (run,
    handle, workspace bytes, workspaces by length for an int cache_seqlens
    (else None), device index, lse shape, whether q is contiguous (its
    strides are, but on dimensions of size 1), the native function that
    sizes a workspace)."""
    batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache = _check_shapes(q, k_cache, v_cache)
    _check_cache_seqlens(cache_seqlens, batch)
    scale = _check_scale(softmax_scale)
    _check_bool("causal", causal)
    num_splits = _check_int("num_splits", num_splits)
    if out is not None:
        _check_out(out, q)
    device = _check_devices(q, k_cache=k_cache, v_cache=v_cache, out=out,
                            cache_seqlens=cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None)
    _check_seqlen_q(seqlen_q)

    native = _native.binding()
    # out=None gets a contiguous tensor of q's shape: its strides are known now.
    out_strides = out.stride() if out is not None else _contiguous_strides(q.shape)
    workspace_bytes, workspaces = 0, None
    try:
        handle = native.Prepare(_DTYPE_CODES[q.dtype], batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache,
                                *q.stride(), *k_cache.stride(), *v_cache.stride(), *out_strides,
                                scale, softmax_scale is None, causal, num_splits, device,
                                isinstance(cache_seqlens, torch.Tensor))
        if type(cache_seqlens) is int:
            workspaces = {}  # filled per length by the hot path
        else:
            workspace_bytes = native.Workspace(handle, -1)
    except Exception as err:
        raise _translate(err) from None
    return (_fast(native, "Run"), handle, workspace_bytes, workspaces, device, (batch, nheads_q, seqlen_q),
            q.is_contiguous(), native.Workspace, ({}, seqlen_cache, 0, native.PlanKeyQuantum()))


def _prepare_serving(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                     cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                     rotary_interleaved, alibi_slopes, num_splits, out):
    """_prepare for a call with serving arguments: check what only Python can
    (types, dtypes, ranks, that the shapes agree, which arguments go
    together, devices), send the layout to the Go core as JSON
    (PrepareServing, which checks the values) and return the same tuple."""
    layout = _serving_layout(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                             rotary_interleaved, alibi_slopes, num_splits, out)
    device = _check_devices(q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos,
                            rotary_sin=rotary_sin,
                            cache_seqlens=cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None,
                            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                            block_table=block_table, alibi_slopes=alibi_slopes, out=out)
    _check_seqlen_q(layout["seqlen_q"])

    native = _native.binding()
    workspace_bytes, workspaces = 0, None
    try:
        handle = native.PrepareServing(json.dumps(layout), device)
        if type(cache_seqlens) is int:
            workspaces = {}
        else:
            workspace_bytes = native.WorkspaceServing(handle, -1)
    except Exception as err:
        raise _translate(err) from None
    batch, seqlen_q, nheads_q = layout["batch"], layout["seqlen_q"], layout["nheads_q"]
    return (_fast(native, "RunServing"), handle, workspace_bytes, workspaces, device, (batch, nheads_q, seqlen_q),
            q.is_contiguous(), native.WorkspaceServing,
            ({}, layout["seqlen_cache"], layout.get("seqlen_new", 0), native.PlanKeyQuantum()))


def _serving_layout(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                    cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                    rotary_interleaved, alibi_slopes, num_splits, out):
    """Check a serving call's arguments (all but the devices and the values
    the Go core checks) and return its layout: PrepareServing's JSON fields,
    strides in elements under each tensor's name."""
    paged = block_table is not None
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t)
    cache_layout = "(num_blocks, page_size, nheads_kv, headdim)" if paged else \
        "(batch, seqlen_cache, nheads_kv, headdim)"
    _check_rank("q", q, "(batch, seqlen_q, nheads_q, headdim)")
    _check_rank("k_cache", k_cache, cache_layout)
    _check_rank("v_cache", v_cache, cache_layout)
    _check_dtypes(q, k_cache=k_cache, v_cache=v_cache)
    batch, seqlen_q, nheads_q, headdim = q.shape
    rows, seqlen_cache, nheads_kv, _ = k_cache.shape
    if k_cache.shape[3] != headdim:
        raise ValueError(f"k_cache must have q's headdim {headdim}, got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")

    layout = dict(dtype=_DTYPE_CODES[q.dtype], batch=batch, seqlen_q=seqlen_q, nheads_q=nheads_q,
                  nheads_kv=nheads_kv, headdim=headdim, seqlen_cache=seqlen_cache,
                  q=q.stride(), k_cache=k_cache.stride(), v_cache=v_cache.stride(),
                  device_lengths=isinstance(cache_seqlens, torch.Tensor))
    if paged:
        _check_tensor("block_table", block_table)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be used with block_table: a paged cache is addressed "
                             "through the block table alone")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be an int32 tensor, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape (batch={batch}, max_blocks), "
                             f"got {tuple(block_table.shape)}")
        max_pages = block_table.shape[1]
        layout.update(page_size=seqlen_cache, num_pages=rows, max_pages=max_pages,
                      seqlen_cache=max_pages * seqlen_cache, block_table=_strides(block_table))
    elif cache_batch_idx is not None:
        _check_index("cache_batch_idx", cache_batch_idx, batch)
        layout.update(cache_batch=rows)
    elif rows != batch:
        raise ValueError(f"k_cache must have shape (batch={batch}, seqlen_cache, nheads_kv, headdim={headdim}) "
                         f"to match q (or give cache_batch_idx), got {tuple(k_cache.shape)}")
    if cache_leftpad is not None:
        _check_index("cache_leftpad", cache_leftpad, batch)
        layout.update(leftpad=True)

    if (k is None) != (v is None):
        missing, given = ("v", "k") if v is None else ("k", "v")
        raise ValueError(f"{missing} is None but {given} is not: the new keys and values are appended together")
    if k is not None:
        new_layout = f"(batch={batch}, seqlen_new, nheads_kv={nheads_kv}, headdim={headdim})"
        for name, t in (("k", k), ("v", v)):
            _check_tensor(name, t)
            _check_rank(name, t, new_layout)
        _check_dtypes(q, k=k, v=v)
        if k.shape[0] != batch or k.shape[2] != nheads_kv or k.shape[3] != headdim or k.shape[1] < 1:
            raise ValueError(f"k must have shape {new_layout} with seqlen_new >= 1, got {tuple(k.shape)}")
        if v.shape != k.shape:
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens is needed with k and v: the new tokens are written at "
                             "cache_seqlens (which the caller advances)")
        layout.update(seqlen_new=k.shape[1], k=k.stride(), v=v.stride())

    if (rotary_cos is None) != (rotary_sin is None):
        missing, given = ("rotary_sin", "rotary_cos") if rotary_sin is None else ("rotary_cos", "rotary_sin")
        raise ValueError(f"{missing} is None but {given} is not: the rotary tables come together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos and rotary_sin need k and v: the rotary embedding is applied to "
                             "the appended keys and to q")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            _check_tensor(name, t)
            _check_rank(name, t, "(seqlen_ro, rotary_dim / 2)")
        _check_dtypes(q, rotary_cos=rotary_cos, rotary_sin=rotary_sin)
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"rotary_sin must have rotary_cos's shape {tuple(rotary_cos.shape)}, "
                             f"got {tuple(rotary_sin.shape)}")
        _check_bool("rotary_interleaved", rotary_interleaved)
        layout.update(rotary_dim=2 * rotary_cos.shape[1], rotary_rows=rotary_cos.shape[0],
                      rotary_cos=_strides(rotary_cos), rotary_sin=_strides(rotary_sin),
                      rotary_interleaved=rotary_interleaved)

    if alibi_slopes is not None:
        _check_tensor("alibi_slopes", alibi_slopes)
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be a float32 tensor, got {alibi_slopes.dtype}")
        if alibi_slopes.shape == (nheads_q,):
            strides = [0, *_strides(alibi_slopes)]  # one slope per head for every sequence
        elif alibi_slopes.shape == (batch, nheads_q):
            strides = _strides(alibi_slopes)
        else:
            raise ValueError(f"alibi_slopes must have shape (nheads_q,) = ({nheads_q},) or (batch, nheads_q) = "
                             f"({batch}, {nheads_q}), got {tuple(alibi_slopes.shape)}")
        layout.update(alibi=True, alibi_slopes=strides)

    layout.update(window_size=_check_window(window_size))
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    layout.update(softcap=_finite("softcap", softcap))

    _check_cache_seqlens(cache_seqlens, batch)
    scale = _check_scale(softmax_scale)
    _check_bool("causal", causal)
    layout.update(softmax_scale=_finite("softmax_scale", scale), default_scale=softmax_scale is None,
                  causal=causal, num_splits=_check_int("num_splits", num_splits))
    if out is not None:
        _check_out(out, q)
    layout.update(out=_contiguous_strides(q.shape) if out is None else out.stride())
    return layout


def _fast(native, name):
    """native's function name, called past gopy's module-level wrapper, which
    only forwards to the extension function."""
    return getattr(getattr(native, "_binding", None), "binding_" + name, None) or getattr(native, name)


def _hint(max_seqlen_k, hints, workspace_fn, handle):
    """(seqlen, workspace bytes) of a max_seqlen_k value whose power of two
    the layout has not met yet. hints = (a bounded dict, the cache's
    capacity, the appended tokens, core.PlanKeyQuantum). The bound is
    rounded up to a power of two 2**e, so that a bound growing a token a
    step meets a new plan at each doubling only, and capped at the
    capacity; seqlen is the core's sizing hint (core.Shape.Seqlen), which
    counts the keys before the appended ones. A positive bound's pair is
    kept in the dict under e (_bound_key), where flash_decode looks it up."""
    cache, capacity, new, _ = hints
    if max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k must not be negative, got {max_seqlen_k}")
    seqlen = _bound_seqlen(max_seqlen_k, capacity, new)
    hinted = seqlen, _workspace_bytes(workspace_fn, handle, seqlen)
    return _remember(cache, _bound_key(max_seqlen_k), hinted) if max_seqlen_k > 0 else hinted


def _bound_key(bound):
    """The exponent e of the power of two 2**e a positive bound rounds up
    to (_bound_seqlen's rounding): every bound with the same key plans
    alike, so a layout keeps one plan a key."""
    return (bound - 1).bit_length()


def _bound_seqlen(bound, capacity, new):
    """The length a bound on the keys a sequence attends is planned for
    (core.Shape.Seqlen, the keys before the new ones): the bound rounded up
    to a power of two and capped at the cache's capacity, less the new
    tokens. flash_decode's max_seqlen_k and plan's seqlen with lengths both
    go through it, so that plan shows what the call runs."""
    bucket = min(capacity, 1 << _bound_key(bound) if bound > 0 else 0)
    return max(0, bucket - new)


def _workspace(workspace_fn, handle, workspaces, seqlen, block):
    """The workspace bytes for an int cache_seqlens value whose block of
    lengths the layout has not met yet, kept in workspaces (a bounded dict)
    under that block."""
    _check_length("cache_seqlens", seqlen)
    return _remember(workspaces, block, _workspace_bytes(workspace_fn, handle, seqlen))


def _workspace_bytes(workspace_fn, handle, seqlen):
    """The workspace a call planned for seqlen keys needs, from the Go core
    (workspace_fn: Workspace or WorkspaceServing, which refuse a value above
    seqlen_cache)."""
    try:
        return workspace_fn(handle, seqlen)
    except Exception as err:
        raise _translate(err) from None


def _remember(cache, key, value):
    """cache[key] = value in a dict bounded by _WORKSPACES_LIMIT; returns value."""
    if len(cache) >= _WORKSPACES_LIMIT:
        cache.clear()
    cache[key] = value
    return value


def plan(batch: int, seqlen_q: int, nheads_q: int, nheads_kv: int, headdim: int, seqlen_cache: int, *,
         dtype: torch.dtype = torch.float16, num_splits: int = 0, device: int | str | torch.device | None = None,
         seqlen: int | None = None, serving: bool = False, seqlen_new: int = 0,
         window_size: tuple[int, int] = (-1, -1), rotary: bool = False, page_size: int = 0,
         lengths: bool = False) -> dict[str, Any]:
    """What :func:`flash_decode` would launch for these shapes, from the Go core.

    This answers "what does num_splits=0 pick": the planner's split count,
    grid, kernel and workspace size, as computed from the shapes and the
    device's SM count and occupancy.

    Args:
        batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache: the
            shapes of q ``(batch, seqlen_q, nheads_q, headdim)`` and the caches
            ``(batch, seqlen_cache, nheads_kv, headdim)``.
        dtype: torch.float16 or torch.bfloat16.
        num_splits: as in :func:`flash_decode` (0: the planner chooses).
        device: a CUDA device (index, ``"cuda:1"`` or torch.device); None is
            the current one (RuntimeError where torch sees no GPU); -1 plans
            for a default H200-like device (132 SMs) without asking a GPU.
        seqlen: the valid length the planner assumes (an int cache_seqlens);
            None plans for the whole cache. With ``lengths`` it is the bound
            a call passes as max_seqlen_k, which is planned as there: rounded
            up to a power of two and capped at seqlen_cache.
        serving: plan the serving kernels (``fd_split_kv_serving_*``), which
            a call with any serving argument runs: block_table,
            cache_batch_idx, cache_leftpad, softcap, alibi_slopes, a window
            or k/v. Of those only the next three change the plan, and any of
            them implies serving.
        seqlen_new: the tokens a call appends (k.shape[1]).
        window_size: as in :func:`flash_decode`; a left bound caps the keys
            the split is planned for.
        rotary: rotary tables given (with seqlen_new): the workspace also
            holds the rotated q.
        page_size: > 0 for a paged cache (block_table) of pages of that
            many keys; implies serving. Pages of a multiple of 8 keys with
            no window run the paged form of the serving kernel
            (``fd_split_kv_paged_*``, one page lookup per 8 keys), provided
            the call has no cache_batch_idx, cache_leftpad, softcap or
            alibi_slopes either, which plan() takes it not to have (nor
            for a contiguous cache's appending form, below).
        lengths: the call passes a cache_seqlens tensor (and no
            cache_leftpad): a batch of several sequences whose plan runs one
            split a sequence or merges its splits through the combine then
            balances them by the lengths on the GPU (``balance_splits``,
            below).

    Returns:
        dict: the core's plan, with at least ``num_splits``, ``grid``,
        ``cluster`` (the thread-block cluster size when the splits merge
        inside the split kernel, else 1), ``workspace_bytes`` (0 unless the
        combine kernel runs), ``kernel`` (the stage-1 kernel's name) and
        ``combine`` (the combine kernel's: 4 warps a row; above 32 splits
        ``_c32``, a block for each 32 columns of a row; or a warp a row and
        ``combine_rows`` 4 or 16 rows a block up to 8 splits; "" when none
        runs) and ``whole_items`` (> 0 for a grid of more
        items than the GPU holds at once: that many batch x K/V head items
        run unsplit and the rest in ``num_splits`` splits each, on a 1-D
        ``grid``) and ``balance_splits`` (> 0 with ``lengths``: the split
        count for equal lengths, each sequence then taking its own, at most
        ``num_splits``, so that every split holds about the same number of
        keys; on a 1-D ``grid``). A call that appends (seqlen_new) shows the append
        kernel as ``append``, or, where stage 1 writes the new tokens
        itself, ``fused_append`` True and no ``append``: at most 16 new
        tokens without rotary, into pages of a multiple of 8 keys
        (``fd_split_kv_paged_append_*``) or into a contiguous cache with
        no other serving argument (``fd_split_kv_append_*``).
        ``variant`` describes the stage-1 kernel; its ``form`` says which
        form runs: "plain", "serving", "paged", "paged_append" or "append".

    Example (on an H200)::

        >>> import torch, flash_decode
        >>> p = flash_decode.plan(1, 1, 32, 8, 128, 32768)
        >>> p["num_splits"], p["grid"], p["cluster"], p["workspace_bytes"], p["combine"]  # doctest: +SKIP
        (16, [16, 8, 1], 1, 264192, 'fd_combine_f16')
        >>> p = flash_decode.plan(1, 1, 32, 8, 128, 1024)
        >>> p["num_splits"], p["cluster"], p["workspace_bytes"]  # doctest: +SKIP
        (8, 8, 0)
        >>> p = flash_decode.plan(1, 1, 32, 8, 128, 1024, seqlen_new=1, page_size=16)  # a paged call appending a token
        >>> p["kernel"], p.get("append"), p["fused_append"]  # doctest: +SKIP
        ('fd_split_kv_paged_append_f16_d128_r16', None, True)
        >>> p = flash_decode.plan(1, 1, 32, 8, 128, 1024, seqlen_new=1, page_size=16, rotary=True)
        >>> p["kernel"], p["append"]  # doctest: +SKIP
        ('fd_split_kv_paged_f16_d128_r16', 'fd_append_kv_f16')
        >>> p = flash_decode.plan(1, 1, 32, 8, 128, 1024, seqlen_new=1, page_size=1)  # pages of 1 key
        >>> p["kernel"], p["append"]  # doctest: +SKIP
        ('fd_split_kv_serving_f16_d128_r16', 'fd_append_kv_f16')
    """
    if dtype not in _DTYPE_CODES:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    shape = [_check_int(name, value) for name, value in (
        ("batch", batch), ("seqlen_q", seqlen_q), ("nheads_q", nheads_q),
        ("nheads_kv", nheads_kv), ("headdim", headdim), ("seqlen_cache", seqlen_cache))]
    seqlen = -1 if seqlen is None else _check_length("seqlen", _check_int("seqlen", seqlen))
    num_splits = _check_int("num_splits", num_splits)
    seqlen_new = _check_length("seqlen_new", _check_int("seqlen_new", seqlen_new))
    page_size = _check_int("page_size", page_size)
    if page_size < 0:
        raise ValueError(f"page_size must be 0 (a contiguous cache) or positive, got {page_size}")
    window = _check_window(window_size)
    if min(window) < -1:
        raise ValueError(f"window_size must be (left, right) with each side -1 (unbounded) or at least 0, "
                         f"got {tuple(window)}")
    for name, flag in (("serving", serving), ("rotary", rotary), ("lengths", lengths)):
        _check_bool(name, flag)
    # What the Go core would refuse under flash_decode's names (cache_seqlens, k), here under plan's.
    if seqlen_new > shape[5]:
        raise ValueError(f"seqlen_new={seqlen_new} exceeds seqlen_cache={shape[5]}")
    if lengths and seqlen >= 0:
        seqlen = _bound_seqlen(seqlen, shape[5], seqlen_new)
    elif seqlen + seqlen_new > shape[5]:
        raise ValueError(f"seqlen={seqlen} and seqlen_new={seqlen_new} exceed seqlen_cache={shape[5]}")
    device = _device_index(device)
    # device < 0 plans for a default H200 in pure Go: no GPU or driver needed.
    native = _native.binding(planner_only=device < 0)
    try:
        if serving or seqlen_new or window != [-1, -1] or rotary or page_size:
            plan_json = native.PlanServing(_DTYPE_CODES[dtype], *shape, seqlen, num_splits, seqlen_new, *window,
                                           rotary, page_size, device, lengths)
        else:
            plan_json = native.Plan(_DTYPE_CODES[dtype], *shape, seqlen, num_splits, device, lengths)
        result = json.loads(plan_json)
    except Exception as err:
        raise _translate(err) from None
    result.setdefault("kernel", result["variant"]["kernel"])
    return result


# The text of a core.Error: "flashdecode: <op>: <argument>: <sentinel>: <what>".
_CORE_ERROR = re.compile(r"flashdecode: \w+: (?:\w+: )?(invalid argument|not supported)\b")


def _check_bound(max_seqlen_k, cache_seqlens):
    """Refuse a max_seqlen_k that is not None or an int, or that comes
    without a cache_seqlens tensor (its value is checked when planned)."""
    if max_seqlen_k is None:
        return
    if type(max_seqlen_k) is not int:
        raise TypeError(f"max_seqlen_k must be an int, got {type(max_seqlen_k).__name__}")
    if type(cache_seqlens) is int:
        raise ValueError("max_seqlen_k is for a cache_seqlens tensor: an int cache_seqlens is planned by itself")
    if cache_seqlens is None:
        raise ValueError("max_seqlen_k needs cache_seqlens as a tensor: without cache_seqlens every sequence "
                         "attends the whole cache")


def _check_window(window_size):
    """window_size as a list of two ints (the Go core checks their values)."""
    if not isinstance(window_size, (tuple, list)):
        raise TypeError(f"window_size must be a tuple of two ints (left, right), got {type(window_size).__name__}")
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a tuple of two ints (left, right), got {tuple(window_size)}")
    return [_check_int("window_size", w) for w in window_size]


def _translate(err):
    """Map a Go error (raised by gopy as RuntimeError with the Go error's text)
    to a Python exception: core.ErrInvalid -> ValueError, core.ErrUnsupported
    -> NotImplementedError, anything else (a CUDA failure, a full table of
    layouts, a Go panic) -> RuntimeError."""
    text = str(err)
    m = _CORE_ERROR.match(text)
    if m is None:
        return RuntimeError(text)
    return ValueError(text) if m.group(1) == "invalid argument" else NotImplementedError(text)


def _device_index(device):
    """plan()'s device as an index (-1: the default H200-like device)."""
    if device is None:
        if not torch.cuda.is_available():  # torch's own error would not name the way out
            raise RuntimeError("plan(device=None) plans for the current CUDA device, and torch sees none; "
                               "device=-1 plans for a default H200-like device (132 SMs) without a GPU")
        return torch.cuda.current_device()
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(f"device must be an int, a str or a torch.device, got {type(device).__name__}")
    if isinstance(device, int):
        if device < -1:
            raise ValueError(f"device={device} must be a CUDA device index, or -1 for the default device")
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


# ---- checks: what the Go core cannot see; the devices' come last ----

def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_bool(name, value):
    """TypeError unless value is a bool (1 is not one, though 1 == True)."""
    if type(value) is not bool:
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _check_int(name, value):
    """Return value as an int; TypeError for bools, floats and non-numbers,
    ValueError past int64 (what the Go core takes)."""
    # No try/except: torch.compile's tracer of torch 2.11 passes on operator.index's own error.
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = operator.index(value)
    if not -_INT64 <= value < _INT64:
        raise ValueError(f"{name}={value} is out of range (a 64-bit int)")
    return value


def _check_length(name, value):
    """Return value, a length, if it is not negative: the Go core reads a
    negative length as "the whole cache"."""
    if value < 0:
        raise ValueError(f"{name}={value} must not be negative (a length in [0, seqlen_cache])")
    if value >= _INT64:
        raise ValueError(f"{name}={value} is out of range (a length in [0, seqlen_cache])")
    return value


def _check_rank(name, t, layout):
    """Raise ValueError unless t has the dimensions layout (a tuple text) names."""
    ndim = layout.count(",") + 1
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(t.shape)}")


def _check_dtypes(q, **others):
    """Raise TypeError unless q is float16 or bfloat16 and the others have its dtype."""
    if q.dtype not in _DTYPE_CODES:
        raise TypeError(f"q must be torch.float16 or torch.bfloat16, got {q.dtype}")
    for name, t in others.items():
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")


def _check_shapes(q, k_cache, v_cache):
    """Check types, ranks and dtypes, and that the shapes agree; return the sizes."""
    tensors = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    for name, t in tensors:
        _check_tensor(name, t)
    for name, t in tensors:
        _check_rank(name, t, "(batch, seqlen_q, nheads_q, headdim)" if name == "q" else
                    "(batch, seqlen_cache, nheads_kv, headdim)")
    _check_dtypes(q, k_cache=k_cache, v_cache=v_cache)

    batch, seqlen_q, nheads_q, headdim = q.shape
    _, seqlen_cache, nheads_kv, _ = k_cache.shape
    for name, t in tensors[1:]:
        if t.shape[0] != batch or t.shape[3] != headdim:
            raise ValueError(f"{name} must have shape (batch={batch}, seqlen_cache, nheads_kv, "
                             f"headdim={headdim}) to match q, got {tuple(t.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    return batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache


def _check_seqlen_q(seqlen_q):
    """Refuse more query tokens than decode kernels take, saying whose job that is."""
    if seqlen_q > MAX_SEQLEN_Q:
        raise NotImplementedError(
            f"seqlen_q: not supported: {seqlen_q}; supported: 1 to {MAX_SEQLEN_Q}. Decode with more than "
            f"{MAX_SEQLEN_Q} query tokens per sequence is prefill's job: use a prefill attention kernel "
            "(flash_attn_with_kvcache, torch's scaled_dot_product_attention) for those steps")


def _check_index(name, t, batch):
    """Check an int32 per-sequence tensor (batch,): type, dtype, shape and
    that it is contiguous (the kernels read element b at b); not its device."""
    _check_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be an int32 tensor, got {t.dtype}")
    if t.shape != (batch,):
        raise ValueError(f"{name} must have shape (batch,) = ({batch},), got {tuple(t.shape)}")
    if batch > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride()}")


def _check_cache_seqlens(cache_seqlens, batch):
    """Check cache_seqlens's type, and a tensor's dtype, shape and stride (not
    its device); an int's value comes with each call (see _workspace)."""
    if cache_seqlens is None or type(cache_seqlens) is int:
        return
    if isinstance(cache_seqlens, torch.Tensor):
        _check_index("cache_seqlens", cache_seqlens, batch)
        return
    raise TypeError("cache_seqlens must be None, an int or an int32 tensor, "
                    f"got {type(cache_seqlens).__name__}")


def _contiguous_strides(shape):
    """The strides of a contiguous tensor of this shape."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _strides(t):
    """t's strides, with the contiguous stride in place of any dimension of
    size 1, whose stride never moves an address (torch leaves it arbitrary):
    the Go core checks a last stride of 1 and the others as layout."""
    contiguous = _contiguous_strides(t.shape)
    return [c if n == 1 else s for n, s, c in zip(t.shape, t.stride(), contiguous)]


def _finite(name, value):
    """Return value as a float if it is finite: the JSON layout has no
    infinities or NaNs (the Go core checks finite values). While
    torch.compile traces, value may be symbolic: it is checked when the op
    runs."""
    if _is_compiling():
        return value
    try:
        value = float(value)
    except OverflowError:  # an int past float64
        value = math.inf
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be finite")
    return value


def _check_scale(softmax_scale):
    """Return softmax_scale as a float for the Go core (0.0 for None, which the
    core reads as its default); the core checks its value."""
    if softmax_scale is None:
        return 0.0
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    try:
        return float(softmax_scale)
    except OverflowError:  # an int past float64: as far out of range as infinity
        return math.inf


def _check_out(out, q):
    _check_tensor("out", out)
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if out.dtype != q.dtype:
        raise TypeError(f"out must have q's dtype {q.dtype}, got {out.dtype}")


def _check_devices(q, **others):
    """Check that q is a CUDA tensor and every other one (others may be None)
    is on its device; return the device index."""
    if q.device.type != "cuda":
        raise ValueError(f"q must be a CUDA tensor, got device {q.device}")
    for name, t in others.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    return q.device.index
