"""merge_states and merge_state: attention computed in parts merged by LSE. Python turns the
states into the core's records (core.MergeTensor) and allocates the results; the Go core checks
the tensors, names the argument at fault and launches."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import _native


def merge_states(outs: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
                 lses: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention states computed over disjoint key sets into the attention over
    all their keys (cascade attention, a cache split across devices): per row,
    ``lse = logsumexp(lse_s)`` and ``out = sum_s exp(lse_s - lse) * out_s``; an LSE of
    -inf is an empty state. One float32 kernel on the current stream, no host sync.
    The full reference is docs/api.md.

    Args:
        outs: ``(num_states, *rows, headdim)``, or a list or tuple of ``(*rows,
            headdim)`` tensors; float16, bfloat16 or float32 on one CUDA device.
        lses: their float32 natural-log LSEs, ``(num_states, *rows)`` or a list or
            tuple; for flash_decode's lse pass ``lse.transpose(1, 2)``.

    Returns:
        ``(out, lse)``: out ``(*rows, headdim)`` in outs' dtype, lse ``(*rows)`` float32.

    Raises:
        TypeError, ValueError, NotImplementedError (a layout the kernel cannot load) or
        RuntimeError (no driver, native failure), naming the argument.

    Example::

        >>> import torch, flash_decode
        >>> outs, lses = torch.randn(2, 4, 32, 128, device="cuda"), torch.randn(2, 4, 32, device="cuda")
        >>> out, lse = flash_decode.merge_states(outs, lses)  # two states of 4 x 32 rows
        >>> torch.allclose(lse, torch.logsumexp(lses, 0), atol=1e-5)
        True
    """
    return _merge(outs, lses, False)


def merge_state(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_states` of ``[out_a, out_b]`` and ``[lse_a, lse_b]``; errors name
    the argument.

    Example::

        >>> import torch, flash_decode
        >>> out_a, out_b = (torch.randn(4, 32, 128, device="cuda") for _ in "ab")
        >>> lse_a, lse_b = (torch.randn(4, 32, device="cuda") for _ in "ab")
        >>> out, lse = flash_decode.merge_state(out_a, lse_a, out_b, lse_b)
    """
    return _merge((out_a, out_b), (lse_a, lse_b), True)


def _merge(outs, lses, pair):
    """merge_states (pair: merge_state's, naming its arguments); while torch.compile traces, the op of
    the stacked states, whose fake kernel has the core check them."""
    o, ls = _tensors("outs", outs, pair and ("out_a", "out_b")), _tensors("lses", lses, pair and ("lse_a", "lse_b"))
    if torch.compiler.is_compiling():
        return torch.ops.flash_decode.merge_states(*(x if isinstance(x, torch.Tensor) else torch.stack(x)
                                                     for x in (outs, lses)))
    flags = isinstance(outs, torch.Tensor) | isinstance(lses, torch.Tensor) << 1 | pair << 2  # core.MergeOutsStacked...
    out = lse = None
    if o:  # the results, before the core checks (a refused call writes nothing)
        out = torch.empty(o[0].shape[flags & 1:], dtype=o[0].dtype, device=o[0].device)
        lse = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
    cuda = out is not None and out.device.type == "cuda"
    native, stream = _native.binding(planner_only=not cuda), _native.current_stream(out.device.index) if cuda else 0
    while True:
        record = _records(native, o + ls + [out, lse])
        if (rows := native.MergeTensors(ctypes.addressof(record), ctypes.sizeof(record), len(o), len(ls), flags,
                                        stream)) >= 0:
            return out, lse
        # A list past the kernel's pointers, or of several layouts, is stacked once the core has checked it.
        if (stacks := native.MergeStacks(ctypes.addressof(record), ctypes.sizeof(record), len(o), len(ls), flags)) <= 0:
            raise _native.error(native, rows)
        o, ls = ([torch.stack(x)] if stacks & bit else x for x, bit in ((o, 1), (ls, 2)))
        flags |= stacks


def _checked(outs, lses):
    """The core's checks of the op's stacked states but for their device (its fake kernel's)."""
    if all(type(n) is int for t in (outs, lses) for n in (*t.shape, *t.stride())):  # not symbolic
        native = _native.binding(planner_only=True)
        record = _records(native, [outs, lses, None, None], data=False)
        if (status := native.MergeStacks(ctypes.addressof(record), ctypes.sizeof(record), 1, 1, 3)) < 0:
            raise _native.error(native, status)


def _tensors(name, x, names):
    """x's tensors: a stacked one, or a list's (names: merge_state's); Python refuses what is not a tensor."""
    if isinstance(x, torch.Tensor):
        return [x]
    if not isinstance(x, (list, tuple)):
        raise TypeError(f"{name} must be a torch.Tensor or a list or tuple of tensors, got {type(x).__name__}")
    for i, t in enumerate(x):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{names[i] if names else f'{name}[{i}]'} must be a torch.Tensor, got {type(t).__name__}")
    return list(x)


@functools.lru_cache(maxsize=None)
def _record(native):
    """The binding's core.MergeTensor record: its struct and the padding of a descriptor's dimensions,
    checked against the order _records packs."""
    places, record = _native.record_format(native, "MergeTensor")
    dims = [f"desc.{a}[{i}]" for a in ("shape", "strides") for i in range(sum("desc.shape[" in f for f in places))]
    if list(places) != ["desc.given", "desc.dtype", "desc.device", "desc.rank", *dims, "data"]:
        raise RuntimeError("flash_decode's native extension has another merge record: reinstall it")
    return record, (0,) * (len(dims) // 2)


def _records(native, tensors, data=True):
    """The core's records (core.MergeTensor) of tensors (None: not given), one after another."""
    record, pad = _record(native)
    n = len(pad)
    packed = b"".join(bytes(record.size) if t is None else record.pack(
        1, _native.DTYPE_CODES.get(t.dtype, 0), t.get_device(), t.dim(), *(tuple(t.shape) + pad)[:n],
        *(t.stride() + pad)[:n], t.data_ptr() if data else 0) for t in tensors)
    return ctypes.create_string_buffer(packed, len(packed))
