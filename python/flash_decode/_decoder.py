"""Decoder: flash_decode planned once for a layout, run with caller-owned memory (for serving
engines and CUDA graphs). The layout is read from example tensors, checked by the core; a call
only compares its tensors' shapes, strides, dtypes and devices with the layout's, then runs."""

from __future__ import annotations

import torch

from . import _api, _native


class Decoder:
    """flash_decode for one layout, with its workspace planned once: calls allocate nothing.

    Built from example tensors (their shapes, strides, dtypes and device are the layout; their
    data is not read) and the options of :func:`flash_decode.flash_decode`, the same names and
    meanings. ``cache_seqlens`` is None (every sequence attends the whole cache) or an int32
    ``(batch,)`` tensor, and ``max_seqlen_k``, if given, the bound every call is planned for.
    With ``cu_seqlens_q`` and ``max_seqlen_q`` (ragged query lengths, as flash_decode takes them) q is
    ``(total_q, nheads_q, headdim)`` and each call passes its own ``cu_seqlens_q`` of the layout.

    ``workspace_bytes`` is the most any call of the layout needs (the core's answer for the
    bound). The decoder allocates that workspace once, or takes ``workspace=``: a uint8 CUDA
    tensor on q's device of at least that many bytes. ``out`` (and ``lse`` with
    ``return_softmax_lse``), if not given, are allocated once at construction and written by
    every call that passes none: copy them before the next call if you keep them.

    A call takes tensors of the layout (q, the caches and, where the layout has them,
    cache_seqlens, block_table, alibi_slopes, descale tensors, sinks, cu_seqlens_q, out, lse; an optional one
    left out is the one given at construction), checks that they match it (ValueError naming the
    argument; nothing launched) and launches on the current stream with no host sync, so it can
    be captured in a CUDA graph once and replayed with new lengths and tables written in place.

    Example::

        >>> import torch, flash_decode
        >>> q = torch.randn(8, 1, 32, 128, dtype=torch.float16, device="cuda")
        >>> k, v = (torch.randn(1024, 16, 8, 128, dtype=torch.float16, device="cuda") for _ in "kv")
        >>> lens = torch.full((8,), 100, dtype=torch.int32, device="cuda")
        >>> table = torch.arange(8 * 128, dtype=torch.int32, device="cuda").view(8, 128)
        >>> dec = flash_decode.Decoder(q, k, v, cache_seqlens=lens, block_table=table, causal=True,
        ...                            max_seqlen_k=2048)
        >>> dec(q, k, v, cache_seqlens=lens, block_table=table).shape
        torch.Size([8, 1, 32, 128])
    """

    def __init__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                 cache_seqlens: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                 softmax_scale: float | None = None, causal: bool = False,
                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 alibi_slopes: torch.Tensor | None = None, num_splits: int = 0,
                 return_softmax_lse: bool = False, out: torch.Tensor | None = None,
                 lse: torch.Tensor | None = None, max_seqlen_k: int | None = None,
                 batch_invariant: bool = False, k_descale: float | torch.Tensor | None = None,
                 v_descale: float | torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                 cu_seqlens_q: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                 workspace: torch.Tensor | None = None):
        if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
            raise TypeError("cache_seqlens must be None or an int32 (batch,) tensor: an int is planned per call "
                            f"(flash_decode takes one), got {type(cache_seqlens).__name__}")
        _api._check_bool("return_softmax_lse", return_softmax_lse)
        _api._check_lengths(cache_seqlens, max_seqlen_k)
        if lse is not None and not return_softmax_lse:
            raise ValueError("lse is given but return_softmax_lse is False")
        run, handle, _, device, lse_shape, _, _, native = _api._prepare(
            None, q, cache_seqlens, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, num_splits=num_splits, out=out, batch_invariant=batch_invariant,
            k_descale=k_descale, v_descale=v_descale, sinks=sinks, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q)
        self._run, self._handle, self._device, self._native = run, handle, device, native
        self._seqlen = -1 if max_seqlen_k is None else max_seqlen_k  # -1: the whole cache
        if (needed := native.Workspace(handle, self._seqlen)) < 0:
            raise _native.error(native, needed)
        self.workspace_bytes = needed
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if return_softmax_lse:
            if lse is None:
                lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
            else:
                _check_lse(lse, lse_shape, q.device)
        self._workspace = self._own_workspace(workspace, q.device)
        arrays = isinstance(k_descale, torch.Tensor)
        # name -> (the layout's signature, the tensor a call that omits it uses); required ones have None.
        given = dict(q=q, k_cache=k_cache, v_cache=v_cache, out=out, lse=lse, cache_seqlens=cache_seqlens,
                     block_table=block_table, alibi_slopes=alibi_slopes, k_descale=k_descale if arrays else None,
                     v_descale=v_descale if arrays else None, sinks=sinks, cu_seqlens_q=cu_seqlens_q)
        self._layout = {name: (_api._sig(t), None if name in ("q", "k_cache", "v_cache") else t)
                        for name, t in given.items()}
        self.return_softmax_lse = return_softmax_lse

    def _own_workspace(self, workspace, device):
        """The caller's workspace, checked, or one of workspace_bytes allocated now (None when none is needed)."""
        if workspace is None:
            return torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device) if self.workspace_bytes else None
        if not isinstance(workspace, torch.Tensor):
            raise TypeError(f"workspace must be a torch.Tensor, got {type(workspace).__name__}")
        if workspace.dtype != torch.uint8 or workspace.dim() != 1 or not workspace.is_contiguous():
            raise ValueError(f"workspace must be a contiguous 1-D torch.uint8 tensor, got {workspace.dtype} of "
                             f"shape {tuple(workspace.shape)} and stride {workspace.stride()}")
        if workspace.device != device:
            raise ValueError(f"workspace must be on q's device {device}, got {workspace.device}")
        if workspace.numel() < self.workspace_bytes:
            raise ValueError(f"workspace must hold at least workspace_bytes={self.workspace_bytes} bytes, "
                             f"got {workspace.numel()}")
        return workspace

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                 cache_seqlens: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                 alibi_slopes: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                 v_descale: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                 cu_seqlens_q: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 lse: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of q over the caches, written into out (and lse); returns out, or (out, lse)."""
        given = dict(q=q, k_cache=k_cache, v_cache=v_cache, out=out, lse=lse, cache_seqlens=cache_seqlens,
                     block_table=block_table, alibi_slopes=alibi_slopes, k_descale=k_descale, v_descale=v_descale,
                     sinks=sinks, cu_seqlens_q=cu_seqlens_q)
        ptrs = {}
        for name, t in given.items():
            sig, default = self._layout[name]
            if t is None:
                t = default
                if t is None and sig is not None:
                    raise ValueError(f"{name} must be a tensor of the decoder's layout {_show(sig)}, got None")
            elif sig is None:
                raise ValueError(f"{name} is given, but the decoder's layout has none: build a Decoder with one")
            elif not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor of the decoder's layout, got {type(t).__name__}")
            elif (got := _api._sig(t)) != sig:
                raise ValueError(f"{name} must match the decoder's layout (shape, stride, dtype, device) "
                                 f"{_show(sig)}, got {_show(got)}")
            ptrs[name] = 0 if t is None else t.data_ptr()
            given[name] = t
        workspace = self._workspace
        status = self._run(self._handle, self._seqlen, ptrs["q"], ptrs["k_cache"], ptrs["v_cache"], ptrs["out"],
                           ptrs["lse"], ptrs["cache_seqlens"], ptrs["block_table"], 0, 0, ptrs["alibi_slopes"],
                           0, 0, 0, 0, ptrs["k_descale"], ptrs["v_descale"], ptrs["sinks"], ptrs["cu_seqlens_q"],
                           0 if workspace is None else workspace.data_ptr(),
                           0 if workspace is None else workspace.numel(), _api._current_stream(self._device))
        if status < 0:
            raise _native.error(self._native, status)
        return (given["out"], given["lse"]) if self.return_softmax_lse else given["out"]


def _check_lse(lse, shape, device):
    """Refuse an lse unless a contiguous float32 tensor of shape (batch, nheads_q, seqlen_q) (ragged:
    (nheads_q, total_q)) on q's device."""
    dims = "(nheads_q, total_q)" if len(shape) == 2 else "(batch, nheads_q, seqlen_q)"
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32:
        raise TypeError(f"lse must be a torch.float32 tensor, got {getattr(lse, 'dtype', type(lse).__name__)}")
    if tuple(lse.shape) != tuple(shape) or not lse.is_contiguous():
        raise ValueError(f"lse must be contiguous of shape {dims} = {tuple(shape)}, "
                         f"got shape {tuple(lse.shape)} and stride {lse.stride()}")
    if lse.device != device:
        raise ValueError(f"lse must be on q's device {device}, got {lse.device}")


def _show(sig):
    shape, stride, dtype, device = sig
    return f"({tuple(shape)}, {stride}, {dtype}, device {device})"
