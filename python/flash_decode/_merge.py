"""merge_states and merge_state: attention computed in parts merged by LSE. Python
checks types, shapes and devices and fits the states to the binding; the Go core checks the values."""

from __future__ import annotations

import torch

from . import _native

_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}  # core.DType
_POINTERS = 8  # the binding's pointers per input (core.MergePointers): more states are stacked
_ROW_DIMS = 3  # the binding's row dimensions (core.MergeRowDims)


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
    return _merge(outs, lses, None, None)


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
    return _merge((out_a, out_b), (lse_a, lse_b), ("out_a", "out_b"), ("lse_a", "lse_b"))


def _merge(outs, lses, out_names, lse_names):
    """merge_states, naming list items out_names, lse_names (None: outs[i], lses[i]); while
    torch.compile traces, the checks that need no device, then the op."""
    o = _States("outs", outs, out_names, None)
    lse_in = _States("lses", lses, lse_names, o)
    if torch.compiler.is_compiling():
        return torch.ops.flash_decode.merge_states(o.stack(), lse_in.stack())
    device, rows = o.tensors[0].device, o.rows
    if device.type != "cuda":
        raise ValueError(f"{o.name} must be on a CUDA device, got {device}")
    if lse_in.tensors[0].device != device:
        raise ValueError(f"{lse_in.name} must be on the device of {o.name}, {device}, got {lse_in.tensors[0].device}")
    out = torch.empty(rows + (o.headdim,), dtype=o.dtype, device=device)
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    if out.numel() == 0:
        return out, lse
    for x in (o, lse_in):  # the binding takes a pointer each of at most 8 tensors of one layout
        if not x.stacked and (len(x.tensors) > _POINTERS or len({t.stride() for t in x.tensors}) > 1):
            x.tensors, x.stacked = [x.stack()], True
    # Row dimensions every tensor steps through as one, joined (the inputs decide); the binding takes three.
    sizes, strides = _join(rows, o.row_strides(), lse_in.row_strides(), out.stride()[:-1], lse.stride())
    if len(sizes) > _ROW_DIMS:
        raise NotImplementedError(f"{o.name} and {lse_in.name}: the strides of the {len(rows)} row dimensions "
                                  f"{rows} do not join into {_ROW_DIMS}; pass contiguous tensors")
    pad = (1,) * (_ROW_DIMS - len(sizes))  # unused dimensions of size 1
    o_st, l_st, out_st, lse_st = (pad + st for st in strides)
    native = _native.binding()
    status = native.MergeStates(_DTYPES[o.dtype], o.count, *(pad + sizes), o.headdim, *o.pointers(), *o_st,
                                *lse_in.pointers(), *l_st, out.data_ptr(), *out_st, lse.data_ptr(), *lse_st,
                                device.index, _native.current_stream(device.index))
    if status < 0:
        raise _native.error(native, status)
    return out, lse


class _States:
    """One input of every state, checked but for the device they share: a stacked tensor or a list
    or tuple of tensors of one shape (names: the items'; None: name[i]). Outputs (of None): a dtype
    the kernel takes, a contiguous last dimension; LSEs (of: the outputs): float32, their rows and count."""

    def __init__(self, name, x, names, of):
        layout = "(num_states, *rows)" if of else "(num_states, *rows, headdim)"
        self.stacked = isinstance(x, torch.Tensor)
        if not self.stacked and not isinstance(x, (list, tuple)):
            raise TypeError(f"{name} must be a torch.Tensor {layout} or a list or tuple of tensors, "
                            f"got {type(x).__name__}")
        if self.stacked and (x.dim() < (1 if of else 2) or x.shape[0] < 1) or not self.stacked and not x:
            raise ValueError(f"{name} must hold at least one state {layout}, got "
                             + (f"shape {tuple(x.shape)}" if self.stacked else f"an empty {type(x).__name__}"))
        names = [name] if self.stacked else names or [f"{name}[{i}]" for i in range(len(x))]
        self.tensors, self.name = [x] if self.stacked else list(x), names[0]
        for item, t in zip(names, self.tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{item} must be a torch.Tensor, got {type(t).__name__}")
        first = self.tensors[0]
        self.dtype, self.count = first.dtype, first.shape[0] if self.stacked else len(self.tensors)
        if of is None and first.dim() < 1:
            raise ValueError(f"{names[0]} must have at least 1 dimension (*rows, headdim), got a 0-d tensor")
        if of is None and self.dtype not in _DTYPES:
            raise TypeError(f"{names[0]} must be torch.float16, torch.bfloat16 or torch.float32, got {self.dtype}")
        shape = tuple(first.shape[self.stacked:])  # one state's
        self.rows, self.headdim = (shape, None) if of else (shape[:-1], shape[-1])
        for item, t in zip(names, self.tensors):
            if of is None and t.shape != first.shape:
                raise ValueError(f"{item} must have {names[0]}'s shape {tuple(first.shape)}, got {tuple(t.shape)}")
            if of is None and t.dtype != first.dtype:
                raise TypeError(f"{item} must have {names[0]}'s dtype {first.dtype}, got {t.dtype}")
            if of is None and t.shape[-1] > 1 and t.stride(-1) != 1:
                raise ValueError(f"{item} must be contiguous in its last dimension (headdim), got strides {t.stride()}")
            if of is not None and tuple(t.shape[self.stacked:]) != of.rows:
                want = (t.shape[0],) + of.rows if self.stacked else of.rows
                raise ValueError(f"{item} must have shape {want} to match {of.name}, got {tuple(t.shape)}")
            if of is not None and t.dtype != torch.float32:
                raise TypeError(f"{item} must be torch.float32, got {t.dtype}")
            if t.device != first.device:
                raise ValueError(f"{item} must be on the device of {names[0]}, {first.device}, got {t.device}")
        if of is not None and self.count != of.count:
            raise ValueError(f"lses must hold num_states={of.count} states to match outs, got {self.count}")

    def stack(self):
        return self.tensors[0] if self.stacked else torch.stack(self.tensors)

    def row_strides(self):
        """The strides of one state's row dimensions."""
        first = int(self.stacked)
        return self.tensors[0].stride()[first:first + len(self.rows)]

    def pointers(self):
        """The binding's arguments: 8 pointers, how many are used, the state stride."""
        ptrs = [t.data_ptr() for t in self.tensors]
        return *ptrs, *[0] * (_POINTERS - len(ptrs)), len(ptrs), self.tensors[0].stride(0) if self.stacked else 0


def _join(sizes, *strides):
    """The sizes and stride sets without dimensions of size 1, neighbours every set steps through as one joined."""
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
