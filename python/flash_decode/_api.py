"""The torch layer: the checks only Python can make (types, ranks, that the
tensors agree in shape, devices), allocation of out / LSE / workspace, the
stream handle, then one call into the Go core, which checks every value
(sizes, strides, options) and names the argument at fault."""

import json
import math
import operator
import re

import torch

from . import _native

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2}  # core.DType

# Layouts seen before (see flash_decode): call signature -> what _prepare returns.
_prepared = {}
_PREPARED_LIMIT = 4096
# Per layout with an int cache_seqlens: workspace bytes by length (the planner
# sizes the splits by it), at most this many lengths.
_WORKSPACES_LIMIT = 1024

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
    checks it; later calls with the same layout only pass the new addresses
    (and an int ``cache_seqlens``, which is not part of the layout).

    Args:
        q: ``(batch, seqlen_q, nheads_q, headdim)``, float16 or bfloat16, with
            1 <= seqlen_q <= 16.
        k_cache, v_cache: ``(batch, seqlen_cache, nheads_kv, headdim)``, q's
            dtype and device; nheads_q must be a multiple of nheads_kv (MHA,
            GQA, MQA). headdim: 64, 128 and 256, and any other multiple of 8
            up to 256; seqlen_cache: 0 to 2**30; batch * nheads_q * seqlen_q
            below 2**31. Every tensor needs a contiguous last dimension; other
            strides are free (a cache may be a slice of a larger buffer).
        cache_seqlens: valid keys per sequence: None (the whole cache), an int
            in [0, seqlen_cache], or an int32 CUDA tensor ``(batch,)`` whose
            values the kernels clamp to [0, seqlen_cache].
        softmax_scale: scale of q.k before the softmax, a positive normal
            float32 (about 1.2e-38 to 3.4e38); None: 1/sqrt(headdim).
        causal: a bool; mask aligned bottom-right: query row i sees keys
            j <= cache_seqlens - seqlen_q + i.
        num_splits: 0 lets the Go core's planner choose (see :func:`plan`);
            n > 0 asks for n, clamped to [1, min(cap, key tiles of the cache)].
        return_softmax_lse: also return the natural-log LSE of each row.
        out: optional tensor of q's shape, dtype and device to write into;
            it must not share memory with q, k_cache, v_cache or
            cache_seqlens.

    Returns:
        ``out`` ``(batch, seqlen_q, nheads_q, headdim)`` in q's dtype, and with
        return_softmax_lse, ``(out, lse)`` where lse is float32
        ``(batch, nheads_q, seqlen_q)``. A row that sees no key gives out = 0
        and lse = -inf.

    Raises:
        TypeError: an argument of the wrong type or dtype.
        ValueError: wrong rank, shape, device, stride or value, or out
            sharing memory with an input; the message names the argument.
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
    # The hot path: a call whose layout (shapes, strides, dtypes, devices and
    # options) was seen before skips the checks; the Go core checks the new
    # addresses and launches. Option values go in with their types: as dict
    # keys True == 1 and 2.0 == 2, and every call must refuse what the first
    # call with that value would. An int cache_seqlens counts as "an int".
    try:
        # get_device(): the CUDA ordinal, -1 off the GPU (never in a cached layout).
        sig = (q.shape, q.stride(), q.dtype, q.get_device(),
               k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.get_device(),
               v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.get_device(),
               cache_seqlens if cache_seqlens is None else int if type(cache_seqlens) is int else
               (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.get_device()),
               type(softmax_scale), softmax_scale, type(causal), causal, type(num_splits), num_splits,
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
    run, handle, workspace_bytes, workspaces, device, lse_shape, q_contiguous = entry

    seqlen, seqlens = -1, 0
    if workspaces is not None:  # an int cache_seqlens
        seqlen = cache_seqlens
        workspace_bytes = workspaces.get(seqlen)
        if workspace_bytes is None:
            workspace_bytes = _workspace(handle, workspaces, seqlen)
    elif cache_seqlens is not None:
        seqlens = cache_seqlens.data_ptr()
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
            0 if lse is None else lse.data_ptr(), seqlens,
            0 if workspace is None else workspace.data_ptr(), workspace_bytes, stream)
    except Exception as err:
        raise _translate(err) from None
    return (out, lse) if return_softmax_lse else out


def _prepare(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, num_splits, out):
    """Check what only Python can, register the layout with the Go core
    (which checks the rest), and return what the hot path needs: (run,
    handle, workspace bytes, workspaces by length for an int cache_seqlens
    (else None), device index, lse shape, whether q's strides are the
    contiguous ones)."""
    batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache = _check_shapes(q, k_cache, v_cache)
    _check_cache_seqlens(cache_seqlens, batch)
    scale = _check_scale(softmax_scale)
    if type(causal) is not bool:
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    num_splits = _check_int("num_splits", num_splits)
    if out is not None:
        _check_out(out, q)
    device = _check_devices(q, k_cache=k_cache, v_cache=v_cache, out=out,
                            cache_seqlens=cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None)

    native = _native.binding()
    # out=None gets a contiguous tensor of q's shape: its strides are known now.
    contiguous = (seqlen_q * nheads_q * headdim, nheads_q * headdim, headdim, 1)
    out_strides = out.stride() if out is not None else contiguous
    workspace_bytes, workspaces = 0, None
    try:
        handle = native.Prepare(_DTYPE_CODES[q.dtype], batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache,
                                *q.stride(), *k_cache.stride(), *v_cache.stride(), *out_strides,
                                scale, softmax_scale is None, causal, num_splits, device)
        if type(cache_seqlens) is int:
            workspaces = {}  # filled per length by the hot path
        else:
            workspace_bytes = native.Workspace(handle, -1)
    except Exception as err:
        raise _translate(err) from None
    # gopy's module-level wrapper only forwards to the extension function.
    run = getattr(getattr(native, "_binding", None), "binding_Run", None) or native.Run
    return (run, handle, workspace_bytes, workspaces, device, (batch, nheads_q, seqlen_q),
            tuple(q.stride()) == contiguous)


def _workspace(handle, workspaces, seqlen):
    """The workspace bytes for an int cache_seqlens value the layout has not
    met yet, from the Go core (which refuses a value above seqlen_cache),
    kept in workspaces (a bounded dict)."""
    _check_length("cache_seqlens", seqlen)
    try:
        workspace_bytes = _native.binding().Workspace(handle, seqlen)
    except Exception as err:
        raise _translate(err) from None
    if len(workspaces) >= _WORKSPACES_LIMIT:
        workspaces.clear()
    workspaces[seqlen] = workspace_bytes
    return workspace_bytes


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
    seqlen = -1 if seqlen is None else _check_length("seqlen", _check_int("seqlen", seqlen))
    num_splits = _check_int("num_splits", num_splits)
    device = _device_index(device)
    # device < 0 plans for a default H200 in pure Go: no GPU or driver needed.
    native = _native.binding(planner_only=device < 0)
    try:
        result = json.loads(native.Plan(_DTYPE_CODES[dtype], *shape, seqlen, num_splits, device))
    except Exception as err:
        raise _translate(err) from None
    result.setdefault("kernel", result["variant"]["kernel"])
    return result


# The text of a core.Error: "flashdecode: <op>: <argument>: <sentinel>: <what>".
_CORE_ERROR = re.compile(r"flashdecode: \w+: (?:\w+: )?(invalid argument|not supported)\b")


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
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


# ---- checks: what the Go core cannot see; the devices' come last ----

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


def _check_length(name, value):
    """Return value, a length, if it is not negative: the Go core reads a
    negative length as "the whole cache"."""
    if value < 0:
        raise ValueError(f"{name}={value} must not be negative (a length in [0, seqlen_cache])")
    return value


def _check_shapes(q, k_cache, v_cache):
    """Check types, ranks and dtypes, and that the shapes agree; return the sizes."""
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
    for name, t in tensors[1:]:
        if t.shape[0] != batch or t.shape[3] != headdim:
            raise ValueError(f"{name} must have shape (batch={batch}, seqlen_cache, nheads_kv, "
                             f"headdim={headdim}) to match q, got {tuple(t.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    return batch, seqlen_q, nheads_q, nheads_kv, headdim, seqlen_cache


def _check_cache_seqlens(cache_seqlens, batch):
    """Check cache_seqlens's type, and a tensor's dtype, shape and stride (not
    its device); an int's value comes with each call (see _workspace)."""
    if cache_seqlens is None or type(cache_seqlens) is int:
        return
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must be an int32 tensor, got {cache_seqlens.dtype}")
        if cache_seqlens.shape != (batch,):
            raise ValueError(f"cache_seqlens must have shape (batch,) = ({batch},), "
                             f"got {tuple(cache_seqlens.shape)}")
        if batch > 1 and cache_seqlens.stride(0) != 1:
            raise ValueError(f"cache_seqlens must be contiguous, got stride {cache_seqlens.stride()}")
        return
    raise TypeError("cache_seqlens must be None, an int or an int32 tensor, "
                    f"got {type(cache_seqlens).__name__}")


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
