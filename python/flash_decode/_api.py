"""The torch layer: argument checks (once per layout), allocation of out / LSE /
workspace, the stream handle, then one call into the Go core."""

import functools
import json
import math
import operator

import torch

from . import _native

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2}  # core.DType
_MAX_SEQLEN_Q = 16
_MAX_HEADDIM = 256
_SUPPORTED_HEADDIMS = "64, 128 and 256, and any other multiple of 8 up to 256"

# Layouts seen before (see flash_decode): call signature -> what _prepare returns.
_prepared = {}
_PREPARED_LIMIT = 4096

_get_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device):
    """The CUstream handle of torch's current stream on device (an index)."""
    if _get_raw_stream is not None:
        return _get_raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


def flash_decode(q, k_cache, v_cache, *, cache_seqlens=None, softmax_scale=None,
                 causal=False, num_splits=0, return_softmax_lse=False, out=None):
    """Attention of a few new query tokens over a KV cache (flash decoding).

    Runs in two stages on ``torch.cuda.current_stream()`` of q's device: a
    split-KV kernel spreads each sequence's keys over all SMs, then the
    per-split partial outputs are merged by their log-sum-exp: inside the
    same kernel when the splits of a sequence fit one thread-block cluster
    (up to 16 on H100/H200), else by a combine kernel. There is no
    host/device synchronization, and the call can be captured in a CUDA
    graph: launch shapes depend on tensor shapes only, so a replay after new
    values are written into ``cache_seqlens`` gives the right answer. The
    first call with a new layout (shapes, strides, dtypes, devices, options)
    checks it; later calls with the same layout only pass the new addresses.

    Args:
        q: ``(batch, seqlen_q, nheads_q, headdim)``, float16 or bfloat16, with
            1 <= seqlen_q <= 16.
        k_cache, v_cache: ``(batch, seqlen_cache, nheads_kv, headdim)``, q's
            dtype and device; nheads_q must be a multiple of nheads_kv (MHA,
            GQA, MQA). headdim: 64, 128 and 256, and any other multiple of 8
            up to 256. Every tensor needs a contiguous last dimension; other
            strides are free (a cache may be a slice of a larger buffer).
        cache_seqlens: valid keys per sequence: None (the whole cache), an int
            in [0, seqlen_cache], or an int32 CUDA tensor ``(batch,)`` whose
            values the kernels clamp to [0, seqlen_cache].
        softmax_scale: positive scale of q.k before the softmax; default
            1/sqrt(headdim).
        causal: mask aligned bottom-right: query row i sees keys
            j <= cache_seqlens - seqlen_q + i.
        num_splits: 0 lets the Go core's planner choose (see :func:`plan`);
            n > 0 asks for n, clamped to [1, min(cap, key tiles of the cache)].
        return_softmax_lse: also return the natural-log LSE of each row.
        out: optional tensor of q's shape, dtype and device to write into.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads_q, headdim)`` in q's dtype, and with
        return_softmax_lse, ``(out, lse)`` where lse is float32
        ``(batch, nheads_q, seqlen_q)``. A row that sees no key gives out = 0
        and lse = -inf.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: wrong rank, shape, device or value; the message names the
            argument.
        NotImplementedError: an unsupported headdim or seqlen_q > 16.
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
    # The hot path: a call whose layout (shapes, strides, dtypes, devices and
    # options) was seen before skips the checks and the 33-argument native
    # call; the Go core checks the new addresses and launches.
    try:
        # get_device(): the CUDA ordinal, -1 off the GPU (never in a cached layout).
        sig = (q.shape, q.stride(), q.dtype, q.get_device(),
               k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.get_device(),
               v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.get_device(),
               cache_seqlens if cache_seqlens is None or type(cache_seqlens) is int else
               (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.get_device()),
               softmax_scale, bool(causal), num_splits,
               None if out is None else (out.shape, out.stride(), out.dtype, out.get_device()))
        entry = _prepared.get(sig)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks will say
        sig = entry = None
    if entry is None:
        entry = _prepare(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, num_splits, out)
        if sig is not None:
            if len(_prepared) >= _PREPARED_LIMIT:
                _prepared.clear()  # the Go core keeps its handles: asking again is cheap
            _prepared[sig] = entry
    run, handle, seqlen, workspace_bytes, device, lse_shape, q_contiguous = entry

    if out is None:
        # A plain empty_like keeps q's strides, which are the contiguous ones
        # the layout was registered with when q_contiguous; it is 0.2 us
        # cheaper than asking for a memory format.
        out = torch.empty_like(q) if q_contiguous else torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = None
    if return_softmax_lse:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    workspace = None
    if workspace_bytes:
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device)
    stream = _current_stream(device)
    try:
        run(handle, seqlen, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            0 if lse is None else lse.data_ptr(),
            0 if cache_seqlens is None or type(cache_seqlens) is int else cache_seqlens.data_ptr(),
            0 if workspace is None else workspace.data_ptr(), workspace_bytes, stream)
    except Exception as err:
        raise _translate(err) from None
    return (out, lse) if return_softmax_lse else out


def _prepare(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, num_splits, out):
    """Check a call's layout with the messages users see, register it with the
    Go core, and return what the hot path needs: (run, handle, seqlen,
    workspace_bytes, device index, lse shape, whether q's strides are the
    contiguous ones)."""
    batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache = _check_shapes(q, k_cache, v_cache)
    seqlen = _check_cache_seqlens(cache_seqlens, batch, seqlen_cache)
    scale = _check_scale(softmax_scale, headdim)
    num_splits = _check_num_splits(num_splits)
    if out is not None:
        _check_out(out, q)
    _check_devices(q, k_cache=k_cache, v_cache=v_cache, out=out,
                   cache_seqlens=cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None)

    native = _native.binding()
    dtype = _DTYPE_CODES[q.dtype]
    device = q.device.index
    workspace_bytes = _plan(native, dtype, batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache,
                            seqlen, num_splits, device)["workspace_bytes"]
    # out=None gets a contiguous tensor of q's shape: its strides are known now.
    contiguous = (seqlen_q * nheads_q * headdim, nheads_q * headdim, headdim, 1)
    out_strides = out.stride() if out is not None else contiguous
    qs, ks, vs = q.stride(), k_cache.stride(), v_cache.stride()
    try:
        handle = native.Prepare(dtype, batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache,
                                qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                                out_strides[0], out_strides[1], out_strides[2],
                                scale, bool(causal), num_splits, device)
    except Exception as err:
        raise _translate(err) from None
    if handle < 0:  # the core's table of layouts is full: the one-shot call checks everything each time
        handle = (dtype, batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache,
                  qs[:3], ks[:3], vs[:3], tuple(out_strides[:3]), scale, bool(causal), num_splits, device)
        run = functools.partial(_decode, native)
    else:
        # gopy's module-level wrapper only forwards to the extension function.
        run = getattr(getattr(native, "_binding", None), "binding_Run", None) or native.Run
    return run, handle, seqlen, workspace_bytes, device, (batch, nheads_q, seqlen_q), tuple(qs) == contiguous


def _decode(native, layout, seqlen, q, k, v, out, lse, seqlens, workspace, workspace_bytes, stream):
    """Run's signature over the core's one-shot Decode (layout as _prepare builds it)."""
    (dtype, batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache,
     qs, ks, vs, os_, scale, causal, num_splits, device) = layout
    return native.Decode(dtype, batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache, seqlen,
                         q, *qs, k, *ks, v, *vs, out, *os_, lse, seqlens, workspace, workspace_bytes,
                         scale, causal, num_splits, device, stream)


def plan(batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache, *,
         dtype=torch.float16, num_splits=0, device=None, seqlen=None):
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
            the current one; -1 plans for a default H200-like device (132 SMs)
            without asking a GPU.
        seqlen: the valid length the planner assumes (an int cache_seqlens);
            None plans for the whole cache, as with a cache_seqlens tensor.

    Returns:
        dict: the core's plan, with at least ``num_splits``, ``grid``,
        ``cluster`` (the thread-block cluster size when the splits merge
        inside the split kernel, else 1), ``workspace_bytes`` (0 unless the
        combine kernel runs), ``kernel`` (the stage-1 kernel's name) and
        ``combine`` (the combine kernel's: 4 warps, or 16 above 32 splits;
        "" when none runs) and ``whole_items`` (> 0 for a grid of more
        items than the GPU holds at once: that many batch x K/V head items
        run unsplit and the rest in ``num_splits`` splits each, on a 1-D
        ``grid``).

    Example (on an H200)::

        >>> import torch, flash_decode
        >>> p = flash_decode.plan(1, 1, 32, 8, 128, 32768)
        >>> p["num_splits"], p["grid"], p["cluster"], p["workspace_bytes"], p["combine"]  # doctest: +SKIP
        (16, [16, 8, 1], 1, 264192, 'fd_combine_f16')
        >>> p = flash_decode.plan(1, 1, 32, 8, 128, 1024)
        >>> p["num_splits"], p["cluster"], p["workspace_bytes"]  # doctest: +SKIP
        (8, 8, 0)
    """
    if dtype not in _DTYPE_CODES:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    shape = [_check_int(name, value) for name, value in (
        ("batch", batch), ("seqlen_q", seqlen_q), ("nheads_q", nheads_q),
        ("nheads_kv", nheads_kv), ("headdim", headdim), ("seqlen_cache", seqlen_cache))]
    seqlen = -1 if seqlen is None else _check_int("seqlen", seqlen)
    num_splits = _check_num_splits(num_splits)
    native = _native.binding()
    return _plan(native, _DTYPE_CODES[dtype], *shape, seqlen, num_splits, _device_index(device))


def _plan(native, *args):
    """Call the binding's Plan and decode its JSON, adding "kernel"."""
    try:
        result = json.loads(native.Plan(*args))
    except Exception as err:
        raise _translate(err) from None
    result.setdefault("kernel", result["variant"]["kernel"])
    return result


def _translate(err):
    """Map a Go error (raised by gopy with the Go error's text) to a Python exception."""
    text = str(err)
    if "not supported" in text:
        return NotImplementedError(text)
    if "invalid argument" in text:
        return ValueError(text)
    return RuntimeError(text)


def _device_index(device):
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


# ---- checks: everything that can be decided without a GPU comes first ----

def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_int(name, value):
    """Return value as an int; TypeError for bools, floats and non-numbers."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _check_shapes(q, k_cache, v_cache):
    """Check types, ranks, dtypes, shapes and strides; return the sizes."""
    tensors = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
    for name, t in tensors:
        _check_tensor(name, t)
    for name, t in tensors:
        if t.dim() != 4:
            layout = "(batch, seqlen_q, nheads_q, headdim)" if name == "q" else \
                "(batch, seqlen_cache, nheads_kv, headdim)"
            raise ValueError(f"{name} must have 4 dimensions {layout}, got shape {tuple(t.shape)}")
    if q.dtype not in _DTYPE_CODES:
        raise TypeError(f"q must be torch.float16 or torch.bfloat16, got {q.dtype}")
    for name, t in tensors[1:]:
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")

    batch, seqlen_q, nheads_q, headdim = q.shape
    _, seqlen_cache, nheads_kv, _ = k_cache.shape
    if batch < 1:
        raise ValueError(f"batch={batch} (q.shape[0]) must be at least 1")
    for name, t in tensors[1:]:
        if t.shape[0] != batch or t.shape[3] != headdim:
            raise ValueError(f"{name} must have shape (batch={batch}, seqlen_cache, nheads_kv, "
                             f"headdim={headdim}) to match q, got {tuple(t.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    if seqlen_q < 1:
        raise ValueError(f"seqlen_q={seqlen_q} (q.shape[1]) must be at least 1")
    if seqlen_q > _MAX_SEQLEN_Q:
        raise NotImplementedError(f"seqlen_q={seqlen_q} (q.shape[1]) is not supported: "
                                  f"1 to {_MAX_SEQLEN_Q} query tokens per sequence are")
    if seqlen_cache < 1:
        raise ValueError(f"seqlen_cache={seqlen_cache} (k_cache.shape[1]) must be at least 1")
    if nheads_q < 1 or nheads_kv < 1 or nheads_q % nheads_kv:
        raise ValueError(f"nheads_q={nheads_q} (q.shape[2]) must be a multiple of "
                         f"nheads_kv={nheads_kv} (k_cache.shape[2])")
    if headdim % 8 or not 8 <= headdim <= _MAX_HEADDIM:
        raise NotImplementedError(f"headdim={headdim} (q.shape[3]) is not supported: "
                                  f"supported are {_SUPPORTED_HEADDIMS}")
    for name, t in tensors:
        if t.stride(3) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (headdim), "
                             f"got strides {t.stride()}")
    return batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache


def _check_cache_seqlens(cache_seqlens, batch, seqlen_cache):
    """Check cache_seqlens (but its device); return the core's seqlen (-1: none)."""
    if cache_seqlens is None:
        return -1
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must be an int32 tensor, got {cache_seqlens.dtype}")
        if cache_seqlens.shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},), "
                             f"got {tuple(cache_seqlens.shape)}")
        if batch > 1 and cache_seqlens.stride(0) != 1:
            raise ValueError(f"cache_seqlens must be contiguous, got stride {cache_seqlens.stride()}")
        return -1
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = int(cache_seqlens)
        if not 0 <= cache_seqlens <= seqlen_cache:
            raise ValueError(f"cache_seqlens={cache_seqlens} must lie in [0, seqlen_cache={seqlen_cache}]")
        return cache_seqlens
    raise TypeError("cache_seqlens must be None, an int or an int32 tensor, "
                    f"got {type(cache_seqlens).__name__}")


def _check_scale(softmax_scale, headdim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        # The core reads 0 as "the default" and rejects negative scales.
        raise ValueError(f"softmax_scale must be finite and positive, got {softmax_scale}")
    return float(softmax_scale)


def _check_num_splits(num_splits):
    num_splits = _check_int("num_splits", num_splits)
    if num_splits < 0:
        raise ValueError(f"num_splits must be 0 (automatic) or positive, got {num_splits}")
    return num_splits


def _check_out(out, q):
    _check_tensor("out", out)
    if out.shape != q.shape:
        raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if out.dtype != q.dtype:
        raise TypeError(f"out must have q's dtype {q.dtype}, got {out.dtype}")
    if out.stride(3) != 1:
        raise ValueError(f"out must be contiguous in its last dimension (headdim), "
                         f"got strides {out.stride()}")


def _check_devices(q, **others):
    """Every tensor on q's CUDA device (others may be None)."""
    if q.device.type != "cuda":
        raise ValueError(f"q must be a CUDA tensor, got device {q.device}")
    for name, t in others.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
