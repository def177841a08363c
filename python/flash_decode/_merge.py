"""merge_states and merge_state: the combine stage on its own, for attention
computed in parts (cascade / shared-prefix attention, keys split across
devices): argument checks, the outputs, then one call into the Go core."""

from __future__ import annotations

import torch

from . import _native
from ._api import _current_stream, _is_compiling, _translate

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}  # core.DType
_MAX_POINTERS = 8   # core.MergePointers: more states are stacked into one tensor
_MAX_ROW_DIMS = 3   # core.MergeRowDims
_MAX_HEADDIM = 256  # core.MaxMergeHeadDim


def merge_states(outs: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
                 lses: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention states computed over disjoint key sets into the
    attention over all their keys.

    Each state is the normalized output of attention over one set of keys
    and its natural-log log-sum-exp (LSE), for the same query rows: a shared
    prefix and each sequence's own keys (cascade attention), the parts of a
    cache held by several GPUs, or flash_decode over several caches. Per row,
    with M the largest LSE::

        lse = M + log(sum_s exp(lse_s - M)),  out = sum_s exp(lse_s - lse) * out_s

    An LSE of -inf is an empty state (its keys were all masked): it weighs
    nothing, whatever its output holds; a row whose states are all empty
    gets out = 0 and lse = -inf. The merge accumulates in float32 and runs
    as one kernel on ``torch.cuda.current_stream()`` of the inputs' device,
    with no host synchronization and no allocation besides the two outputs
    (and a stacked copy of a list that cannot be passed as it is, see
    below), so it can be captured in a CUDA graph. It is not differentiable.
    Under torch.compile it is the custom op ``flash_decode::merge_states``
    of stacked states (a list is stacked first), with no graph break.

    FlashInfer's ``merge_states(v, s)`` takes the states in dimension 1
    (``(seq_len, num_states, ...)``); here they are dimension 0: pass
    ``v.movedim(1, 0), s.movedim(1, 0)``. LSEs here are natural logs:
    multiply base-2 ones (as some kernels return them) by ``math.log(2)``.

    Args:
        outs: the states' outputs: a tensor ``(num_states, *rows, headdim)``,
            or a list or tuple of num_states tensors ``(*rows, headdim)`` of
            one shape; float16, bfloat16 or float32, on one CUDA device.
            headdim: a multiple of 4 from 4 to 256, contiguous (stride 1).
            rows: any shape whose strides form at most 3 dimensions once
            dimensions that step together are joined (any contiguous or
            transposed layout of up to 3 dimensions does); strides that are
            multiples of 4 elements and addresses aligned to 4 elements (a
            freshly allocated tensor is; a view at an odd offset may not be,
            and its .clone() is). A list of more than 8 tensors, or of
            tensors with different strides, is stacked into a new tensor
            first.
        lses: their float32 LSEs, natural log: a tensor ``(num_states,
            *rows)`` or a list or tuple of num_states tensors ``(*rows)``,
            any strides, on outs' device. For flash_decode's results, whose
            out is ``(batch, seqlen_q, nheads_q, headdim)`` and lse ``(batch,
            nheads_q, seqlen_q)``, pass ``lse.transpose(1, 2)``.

    Returns:
        ``(out, lse)``: out ``(*rows, headdim)`` in outs' dtype and lse
        ``(*rows)`` float32, both new contiguous tensors.

    Raises:
        TypeError: outs or lses is not a tensor or a list of tensors, or of
            a wrong dtype.
        ValueError: shapes that do not match, no states, a non-contiguous
            headdim, CPU tensors or several devices; the message names the
            argument.
        NotImplementedError: an unsupported headdim, more than 3 row
            dimensions that cannot be joined, or strides and addresses the
            kernel cannot load 4 elements at a time from.
        RuntimeError: no usable CUDA driver, or a failure in the native code.

    Example (cascade attention: a prefix every sequence shares, then each
    sequence's own keys)::

        >>> import torch, flash_decode
        >>> q = torch.randn(8, 1, 32, 128, dtype=torch.float16, device="cuda")
        >>> k_prefix = torch.randn(1, 4096, 8, 128, dtype=torch.float16, device="cuda")
        >>> v_prefix = torch.randn_like(k_prefix)
        >>> k, v = (torch.randn(8, 512, 8, 128, dtype=torch.float16, device="cuda") for _ in "kv")
        >>> o1, l1 = flash_decode.flash_decode(q, k_prefix.expand(8, -1, -1, -1),
        ...                                    v_prefix.expand(8, -1, -1, -1), return_softmax_lse=True)
        >>> o2, l2 = flash_decode.flash_decode(q, k, v, return_softmax_lse=True)
        >>> out, lse = flash_decode.merge_states([o1, o2], [l1.transpose(1, 2), l2.transpose(1, 2)])
        >>> out.shape, lse.shape
        (torch.Size([8, 1, 32, 128]), torch.Size([8, 1, 32]))
    """
    if _is_compiling():
        return _traced(outs, lses, None, None)
    return _merge(outs, lses, None, None)


def merge_state(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states: :func:`merge_states` of ``[out_a, out_b]``
    and ``[lse_a, lse_b]``.

    Args:
        out_a, out_b: ``(*rows, headdim)``, float16, bfloat16 or float32, one
            shape, dtype and CUDA device.
        lse_a, lse_b: ``(*rows)`` float32 natural-log LSEs (-inf: an empty
            state), on the same device.

    Returns:
        ``(out, lse)`` as :func:`merge_states` does. Errors name out_a,
        lse_a, out_b or lse_b (those the Go core finds, such as alignment,
        name outs or lses and the state: 0 for a, 1 for b).

    Example::

        >>> import torch, flash_decode
        >>> out_a, out_b = (torch.randn(4, 32, 128, device="cuda") for _ in "ab")
        >>> lse_a, lse_b = (torch.randn(4, 32, device="cuda") for _ in "ab")
        >>> out, lse = flash_decode.merge_state(out_a, lse_a, out_b, lse_b)
        >>> torch.allclose(lse, torch.logaddexp(lse_a, lse_b), atol=1e-5)
        True
    """
    names = ("out_a", "out_b"), ("lse_a", "lse_b")
    if _is_compiling():
        return _traced((out_a, out_b), (lse_a, lse_b), *names)
    return _merge((out_a, out_b), (lse_a, lse_b), *names)


def _traced(outs, lses, out_names, lse_names):
    """merge_states while torch.compile traces: the arguments checked as the
    eager call checks them (but the devices, and what only addresses tell),
    a list stacked, then the op flash_decode::merge_states."""
    o, lse_in = _check(outs, lses, out_names, lse_names)
    stacked = [x.tensors[0] if x.stacked else torch.stack(x.tensors) for x in (o, lse_in)]
    return torch.ops.flash_decode.merge_states(*stacked)


def _check(outs, lses, out_names, lse_names):
    """The checks of merge_states that need no device: outs and lses as
    _States of one count, dtype and head dim the kernel takes."""
    o = _states("outs", outs, out_names, headdim=True)
    dtype, num_states, rows, headdim = o.dtype, o.count, o.rows, o.headdim
    if dtype not in _DTYPE_CODES:
        raise TypeError(f"{o.name} must be torch.float16, torch.bfloat16 or torch.float32, got {dtype}")
    if headdim % 4 or not 4 <= headdim <= _MAX_HEADDIM:
        raise NotImplementedError(f"headdim={headdim} ({o.name}.shape[-1]) is not supported: "
                                  f"multiples of 4 from 4 to {_MAX_HEADDIM} are")
    lse_in = _states("lses", lses, lse_names, headdim=False, rows=rows, of=o.name)
    if lse_in.count != num_states:
        raise ValueError(f"lses must hold num_states={num_states} states to match outs, got {lse_in.count}")
    return o, lse_in


def _merge(outs, lses, out_names, lse_names):
    """merge_states, with names for the list items in messages (None:
    outs[i] and lses[i])."""
    o, lse_in = _check(outs, lses, out_names, lse_names)
    dtype, device, num_states, rows, headdim = o.dtype, o.device, o.count, o.rows, o.headdim
    if device.type != "cuda":
        raise ValueError(f"{o.name} must be on a CUDA device, got {device}")
    if lse_in.device != device:
        raise ValueError(f"{lse_in.name} must be on the device of {o.name}, {device}, got {lse_in.device}")

    out = torch.empty(rows + (headdim,), dtype=dtype, device=device)
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out, lse
    o.pack(_MAX_POINTERS)
    lse_in.pack(_MAX_POINTERS)
    # Join the row dimensions that every tensor steps through as one (the
    # outputs are contiguous: the inputs decide); the kernel takes three.
    sizes, (o_st, l_st, out_st, lse_st) = _join(rows, o.row_strides(), lse_in.row_strides(),
                                                out.stride()[:-1], lse.stride())
    if len(sizes) > _MAX_ROW_DIMS:
        raise NotImplementedError(f"{o.name} and {lse_in.name}: the strides of the {len(rows)} row "
                                  f"dimensions {rows} do not join into {_MAX_ROW_DIMS}; pass contiguous tensors")
    pad = (1,) * (_MAX_ROW_DIMS - len(sizes))
    sizes = pad + sizes
    o_st, l_st, out_st, lse_st = (pad + st for st in (o_st, l_st, out_st, lse_st))  # size-1 strides: unused

    native = _native.binding()
    index = device.index
    try:
        native.MergeStates(_DTYPE_CODES[dtype], num_states, *sizes, headdim,
                           *o.pointers(_MAX_POINTERS), o.num_ptrs, o.state_stride, *o_st,
                           *lse_in.pointers(_MAX_POINTERS), lse_in.num_ptrs, lse_in.state_stride, *l_st,
                           out.data_ptr(), *out_st, lse.data_ptr(), *lse_st,
                           index, _current_stream(index))
    except Exception as err:
        raise _translate(err) from None
    return out, lse


class _States:
    """One input of every state (their outputs or their LSEs), checked by
    _states: a stacked tensor, or a list of tensors of one shape, dtype and
    device."""

    def __init__(self, name, tensors, stacked, headdim):
        self.name = name        # for messages: "outs" (stacked), "outs[0]", "out_a", ...
        self.tensors = tensors  # the list items, or [the stacked tensor]
        self.stacked = stacked
        first = tensors[0]
        self.dtype, self.device = first.dtype, first.device
        self.count = first.shape[0] if stacked else len(tensors)
        shape = tuple(first.shape[1:] if stacked else first.shape)  # one state's
        self.rows = shape[:-1] if headdim else shape
        self.headdim = shape[-1] if headdim else None

    def row_strides(self):
        """The strides of one state's row dimensions."""
        first = 1 if self.stacked else 0
        return self.tensors[0].stride()[first:first + len(self.rows)]

    def pack(self, limit):
        """Stack a list the kernel cannot take a pointer each of: more than
        limit tensors, or tensors of different strides."""
        if self.stacked or (len(self.tensors) <= limit and
                            all(t.stride() == self.tensors[0].stride() for t in self.tensors)):
            return
        self.tensors = [torch.stack(self.tensors)]
        self.stacked = True

    @property
    def num_ptrs(self):
        return 1 if self.stacked else len(self.tensors)

    @property
    def state_stride(self):
        return self.tensors[0].stride(0) if self.stacked else 0

    def pointers(self, limit):
        ptrs = [t.data_ptr() for t in self.tensors]
        return ptrs + [0] * (limit - len(ptrs))


def _states(name, x, names, headdim, rows=None, of=None):
    """Check that x, the argument name, is a tensor of stacked states or a
    list or tuple of tensors (names: of its items, None for name[i]) and
    return it as _States. Outputs (headdim): one shape and dtype, a
    contiguous last dimension. LSEs (rows given): float32 tensors of those
    rows, of the outputs called of. One device, either way."""
    layout = "(num_states, *rows, headdim)" if headdim else "(num_states, *rows)"
    if isinstance(x, torch.Tensor):
        if x.dim() < (2 if headdim else 1):
            raise ValueError(f"{name} must have at least {2 if headdim else 1} dimensions {layout}, "
                             f"got shape {tuple(x.shape)}")
        if x.shape[0] < 1:
            raise ValueError(f"{name} must hold at least one state, got shape {tuple(x.shape)}")
        tensors, names, stacked = [x], [name], True
    elif isinstance(x, (list, tuple)):
        if not x:
            raise ValueError(f"{name} must hold at least one state, got an empty {type(x).__name__}")
        names = names or [f"{name}[{i}]" for i in range(len(x))]
        for item, t in zip(names, x):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{item} must be a torch.Tensor, got {type(t).__name__}")
        tensors, stacked, name = list(x), False, names[0]
    else:
        raise TypeError(f"{name} must be a torch.Tensor {layout} or a list or tuple of tensors, "
                        f"got {type(x).__name__}")
    first = tensors[0]
    if headdim:
        if not stacked and first.dim() < 1:
            raise ValueError(f"{name} must have at least 1 dimension (*rows, headdim), got a 0-d tensor")
        for item, t in zip(names[1:], tensors[1:]):
            if t.shape != first.shape:
                raise ValueError(f"{item} must have {name}'s shape {tuple(first.shape)}, got {tuple(t.shape)}")
            if t.dtype != first.dtype:
                raise TypeError(f"{item} must have {name}'s dtype {first.dtype}, got {t.dtype}")
        for item, t in zip(names, tensors):
            if t.shape[-1] > 1 and t.stride(-1) != 1:
                raise ValueError(f"{item} must be contiguous in its last dimension (headdim), "
                                 f"got strides {t.stride()}")
    else:
        for item, t in zip(names, tensors):
            shape = tuple(t.shape[1:] if stacked else t.shape)
            if shape != rows:
                want = (t.shape[0],) + rows if stacked else rows
                raise ValueError(f"{item} must have shape {want} to match {of}, got {tuple(t.shape)}")
            if t.dtype != torch.float32:
                raise TypeError(f"{item} must be torch.float32, got {t.dtype}")
    for item, t in zip(names[1:], tensors[1:]):
        if t.device != first.device:
            raise ValueError(f"{item} must be on the device of {name}, {first.device}, got {t.device}")
    return _States(name, tensors, stacked, headdim)


def _join(sizes, *strides):
    """Drop dimensions of size 1 and join neighbours that every stride set
    steps through as one (outer stride = inner stride * inner size); return
    the sizes and the stride sets, as tuples."""
    dims = []  # (size, [stride per set])
    for i, n in enumerate(sizes):
        if n == 1:
            continue
        st = [s[i] for s in strides]
        if dims and all(outer == inner * n for outer, inner in zip(dims[-1][1], st)):
            dims[-1] = (dims[-1][0] * n, st)
        else:
            dims.append((n, st))
    return tuple(n for n, _ in dims), tuple(tuple(st[k] for _, st in dims) for k in range(len(strides)))
