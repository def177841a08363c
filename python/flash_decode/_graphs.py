"""DecoderGraphs: one CUDA graph of a Decoder call per batch-size bucket, as serving engines capture
them (vLLM's capture sizes, SGLang's CUDA graph runner). Static buffers sized for the largest bucket;
a step of n sequences is padded to the smallest bucket that holds it (padding rows have length 0)
and replays that bucket's graph with the step's lengths, tables and queries written in place."""

from __future__ import annotations

import bisect

import torch

from ._decoder import Decoder

# Options that may hold a row per sequence ((batch, ...) tensors): each bucket gets its first rows.
_PER_SEQUENCE = ("alibi_slopes", "k_descale", "v_descale")


class DecoderGraphs:
    """A :class:`flash_decode.Decoder` per batch-size bucket over shared static buffers, each
    captured once in a CUDA graph and replayed at every step: a step allocates nothing.

    ``q`` is an example query ``(any batch, seqlen_q, nheads_q, headdim)``; ``k_cache`` and
    ``v_cache`` are the caches the graphs read (write new keys into them in place): paged, with
    ``max_blocks`` the width of the block table, or contiguous with a row per sequence of the
    largest bucket (bucket b reads the first b rows); the other keywords are
    the Decoder's options (``causal``, ``max_seqlen_k``, ``return_softmax_lse``, ...). A 2-D
    ``alibi_slopes`` or descale tensor has a row per sequence of the largest bucket, sliced per
    bucket: write each step's rows into it in place.

    Buffers, sized for the largest bucket: ``q``, ``cache_seqlens`` (int32), ``block_table``
    (int32, when paged), ``out`` and ``lse``; the buckets share one workspace. ``graphs(q,
    cache_seqlens, block_table)`` copies a step of n sequences into them, zeroes the lengths of
    the padding rows, replays the bucket's graph (capturing it the first time) and returns views of
    ``out`` (and ``lse``) for the n sequences, valid until the next step. ``capture()`` captures every
    bucket up front. An engine that captures its own model graph uses ``prepare`` and ``run``.

    Example::

        >>> import torch, flash_decode
        >>> q = torch.randn(3, 1, 32, 128, dtype=torch.float16, device="cuda")
        >>> k, v = (torch.randn(1024, 16, 8, 128, dtype=torch.float16, device="cuda") for _ in "kv")
        >>> graphs = flash_decode.DecoderGraphs(q, k, v, buckets=(1, 2, 4, 8), max_blocks=128,
        ...                                     causal=True, max_seqlen_k=2048)
        >>> lens = torch.tensor([100, 7, 2048], dtype=torch.int32, device="cuda")
        >>> table = torch.randperm(1024, device="cuda").to(torch.int32)[:384].view(3, 128)
        >>> graphs(q, lens, table).shape  # bucket 4's graph, its last row padding
        torch.Size([3, 1, 32, 128])
    """

    def __init__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                 buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), max_blocks: int | None = None, **options):
        if isinstance(buckets, int) or not buckets or not all(isinstance(b, int) and b >= 1 for b in buckets):
            raise ValueError(f"buckets must be a non-empty sequence of batch sizes of 1 or more, got {buckets!r}")
        if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks < 1):
            raise ValueError(f"max_blocks must be None (contiguous caches) or 1 or more, got {max_blocks!r}")
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError("q must be an example (batch, seqlen_q, nheads_q, headdim) tensor")
        self.buckets = sorted(set(buckets))
        top, device = self.buckets[-1], q.device
        per_sequence = {name: options.pop(name) for name in _PER_SEQUENCE
                        if isinstance(options.get(name), torch.Tensor) and options[name].dim() == 2}
        for name, t in per_sequence.items():
            if t.shape[0] != top:
                raise ValueError(f"{name} must have a row per sequence of the largest bucket ({top}), "
                                 f"got shape {tuple(t.shape)}")
        self.q = torch.zeros((top, *q.shape[1:]), dtype=q.dtype, device=device)
        self.out = torch.zeros_like(self.q)
        self.lse = torch.zeros(top, q.shape[2], q.shape[1], dtype=torch.float32, device=device) \
            if options.get("return_softmax_lse") else None
        self.cache_seqlens = torch.zeros(top, dtype=torch.int32, device=device)
        self.block_table = None if max_blocks is None else torch.zeros(top, max_blocks, dtype=torch.int32,
                                                                        device=device)
        self.k_cache, self.v_cache = k_cache, v_cache

        def decoder(b, workspace=None):
            rows = lambda t: None if t is None else t[:b]  # noqa: E731
            return Decoder(self.q[:b], *self._caches(b, k_cache, v_cache), cache_seqlens=self.cache_seqlens[:b],
                           block_table=rows(self.block_table), out=self.out[:b], lse=rows(self.lse),
                           workspace=workspace, **{n: t[:b] for n, t in per_sequence.items()}, **options)

        # The buckets replay one at a time on one stream, so they share the largest workspace
        # (each sizing pass holds its own only until the next).
        need = max(decoder(b).workspace_bytes for b in self.buckets)
        self.workspace = torch.empty(need, dtype=torch.uint8, device=device) if need else None
        self.decoders = {b: decoder(b, self.workspace) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds n sequences."""
        i = bisect.bisect_left(self.buckets, n)
        if n < 1 or i == len(self.buckets):
            raise ValueError(f"cache_seqlens must hold 1 to {self.buckets[-1]} sequences (the largest "
                             f"bucket), got {n}")
        return self.buckets[i]

    def prepare(self, cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
                q: torch.Tensor | None = None) -> int:
        """Write a step of n sequences into the buffers, padding rows after them at length 0;
        returns the bucket. Tensors on the buffers' device copy without a host sync."""
        if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dim() != 1:
            raise ValueError("cache_seqlens must be a (batch,) tensor")
        n = cache_seqlens.shape[0]
        b = self.bucket(n)
        if q is not None and (not isinstance(q, torch.Tensor) or q.shape != (n, *self.q.shape[1:])):
            raise ValueError(f"q must be of shape {(n, *self.q.shape[1:])}, got {getattr(q, 'shape', q)}")
        if block_table is not None:
            if self.block_table is None:
                raise ValueError("block_table is given, but the graphs were built without max_blocks")
            width = self.block_table.shape[1]
            if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or \
                    block_table.shape[0] != n or block_table.shape[1] > width:
                raise ValueError(f"block_table must be a ({n}, at most {width}) tensor, "
                                 f"got {tuple(getattr(block_table, 'shape', ()))}")
            self.block_table[:n, :block_table.shape[1]].copy_(block_table)
        if q is not None:
            self.q[:n].copy_(q)
        self.cache_seqlens[:n].copy_(cache_seqlens)
        if b > n:
            self.cache_seqlens[n:b].zero_()  # padding rows attend no key: their outputs are 0, ignored
        return b

    def run(self, b: int, q: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
            v_cache: torch.Tensor | None = None, out: torch.Tensor | None = None):
        """Bucket b's Decoder call over the buffers, eager (what a capture records); q, the caches
        and out of the same layout may stand in for the buffers (a model's layers)."""
        return self.decoders[b](self.q[:b] if q is None else q, *self._caches(b, k_cache, v_cache), out=out)

    def _caches(self, b, k_cache=None, v_cache=None):
        """The caches bucket b reads: paged ones whole, contiguous ones' first b rows."""
        k, v = (self.k_cache if k_cache is None else k_cache), (self.v_cache if v_cache is None else v_cache)
        return (k, v) if self.block_table is not None else (k[:b], v[:b])

    def capture(self, buckets=None) -> None:
        """Capture the graphs of buckets (default all) not captured yet, largest first."""
        for b in sorted({self.bucket(n) for n in (self.buckets if buckets is None else buckets)}, reverse=True):
            if b not in self.graphs:
                self.graphs[b] = _capture(lambda b=b: self.run(b), self.q.device)

    def __call__(self, q: torch.Tensor, cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None):
        """One step: prepare, replay the bucket's graph (captured now if it is not yet), and return
        out (and lse) for the step's sequences: views of the buffers, valid until the next step."""
        n = cache_seqlens.shape[0] if isinstance(cache_seqlens, torch.Tensor) else 0
        b = self.prepare(cache_seqlens, block_table, q)
        if b not in self.graphs:
            self.capture([b])
        self.graphs[b].replay()
        return self.out[:n] if self.lse is None else (self.out[:n], self.lse[:n])


def _capture(call, device):
    """call() warmed up on a side stream (the first call on a device loads the kernels), then
    captured in a new CUDA graph, which is returned."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph
