"""Context-parallel decode: a KV cache sharded along its length over the ranks of a torch.distributed
group, each rank running flash_decode over its shard, the shards' (out, lse) all-gathered and merged by
their LSEs into the whole cache's attention on every rank. Reference: docs/api.md, "Decode past one GPU"."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._api import flash_decode
from ._merge import merge_states

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # an integer dtype of each element size
_ALIGN = 16  # bytes: each rank's packed state starts where the kernels can load it


class Shards:
    """Where each key of a sequence lives: block-cyclic over ``world_size`` ranks, block p (keys
    ``[p * block, (p + 1) * block)``) on rank ``p % world_size`` as its local block ``p // world_size``.
    Each rank keeps its keys in position order, so a rank's keys below a global length are a prefix of
    its local cache, and the next key a rank receives is the one after its local length.

    ``Shards.contiguous(w, n)``: rank r holds positions ``[r * n, (r + 1) * n)``;
    ``Shards.interleaved(w)``: key j on rank ``j % w`` (block 1); ``Shards.pages(w, page_size)``: whole
    pages round robin. Every method takes ints or int tensors (elementwise, on their device, no sync).

    Example::

        >>> s = Shards.pages(2, 4)                # pages of 4 keys, alternating between 2 ranks
        >>> s.local_length(10, 0), s.local_length(10, 1)
        (6, 4)
        >>> s.rank_of(9), s.local_index(9), s.global_position(0, 5)
        (0, 5, 9)
    """

    def __init__(self, world_size: int, block: int) -> None:
        for name, value in (("world_size", world_size), ("block", block)):
            if type(value) is not int:
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.world_size, self.block = world_size, block

    @classmethod
    def contiguous(cls, world_size: int, tokens_per_rank: int) -> Shards:
        """Rank r holds positions ``[r * tokens_per_rank, (r + 1) * tokens_per_rank)`` (past
        ``world_size * tokens_per_rank`` the ranges start again at rank 0)."""
        return cls(world_size, tokens_per_rank)

    @classmethod
    def interleaved(cls, world_size: int) -> Shards:
        """Key j on rank ``j % world_size`` at local index ``j // world_size``."""
        return cls(world_size, 1)

    @classmethod
    def pages(cls, world_size: int, page_size: int) -> Shards:
        """Page p (keys ``[p * page_size, (p + 1) * page_size)``) on rank ``p % world_size``."""
        return cls(world_size, page_size)

    def __repr__(self):
        return f"Shards(world_size={self.world_size}, block={self.block})"

    def __eq__(self, other):
        return isinstance(other, Shards) and (self.world_size, self.block) == (other.world_size, other.block)

    def rank_of(self, position):
        """The rank holding the key at a global position."""
        return position // self.block % self.world_size

    def local_index(self, position):
        """Where the key at a global position lies in its rank's local cache."""
        return position // self.block // self.world_size * self.block + position % self.block

    def global_position(self, rank, local_index):
        """The global position of rank's local key ``local_index``."""
        return (local_index // self.block * self.world_size + rank) * self.block + local_index % self.block

    def local_length(self, length, rank):
        """How many of a sequence's first ``length`` keys rank holds (a tensor's negative lengths count 0,
        as the kernels clamp them)."""
        self._check_rank(rank)
        if isinstance(length, torch.Tensor):
            length = length.clamp(min=0)
        elif length < 0:
            raise ValueError(f"length must not be negative, got {length}")
        full, rest = length // self.block, length % self.block
        blocks = (full + self.world_size - 1 - rank) // self.world_size  # whole blocks of rank below full
        tail = full % self.world_size == rank
        partial = torch.where(tail, rest, 0) if isinstance(tail, torch.Tensor) else rest * tail
        return blocks * self.block + partial

    def positions(self, rank: int, local_length: int, device=None) -> torch.Tensor:
        """The global positions (int64) of rank's first ``local_length`` local keys."""
        self._check_rank(rank)
        return self.global_position(rank, torch.arange(local_length, device=device))

    def shard(self, x: torch.Tensor, rank: int, length: int | None = None, dim: int = 1) -> torch.Tensor:
        """Rank's keys of a whole-cache tensor (keys along ``dim``, ``length`` of them, default all): a
        copy, for tests, benchmarks and loading a prefilled cache."""
        length = x.shape[dim] if length is None else length
        index = self.positions(rank, self.local_length(length, rank), device=x.device)
        return x.index_select(dim, index)

    def _check_rank(self, rank):
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None = None,
           v: torch.Tensor | None = None, *, shards: Shards, group: dist.ProcessGroup | None = None,
           return_softmax_lse: bool = False, **options) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flash_decode over a KV cache sharded along its length over ``group``'s ranks (default: the
    world): each rank passes its own shard (``k_cache``, ``v_cache`` and, paged, its ``block_table``)
    and the same q and options, with lengths and bounds given as the whole sequence's (global). Every
    rank gets the whole cache's ``out`` (and ``lse`` with return_softmax_lse), bit-identical on every
    rank and to :func:`decode_shards` of the same shards. One all-gather of each rank's (out, lse),
    merged by LSE; the merge is ``merge_states`` on CUDA tensors and float32 torch on CPU ones.

    k, v: the step's new tokens ``(batch, seqlen_new, nheads_kv, headdim)``, rotated by the caller at
    their global positions, as flash_decode's k, v: attended (the shards' cached keys, merged with one
    call over the new tokens alone, causal bottom-right, on every rank), then written into the ranks
    that hold their positions (:func:`append`); cache_seqlens counts the keys before them.

    options are flash_decode's: cache_seqlens (None: every rank's whole shard), cache_batch_idx,
    cache_leftpad, block_table, softmax_scale, causal (with seqlen_q > 1 only with at least seqlen_q
    new tokens), window_size (``(-1, right)``, seqlen_q 1 only), softcap, num_splits, max_seqlen_k,
    batch_invariant, k_descale, v_descale and sinks (rank 0's call counts them, once). Refused by name
    (``NotImplementedError``): options whose scores depend on a key's global position, which a shard's
    call numbers from 0 (alibi_slopes, a left window, causal over cached keys only, rotary).

    Example (each of 2 processes, one GPU each, holds every other page of 16 keys)::

        >>> shards = Shards.pages(dist.get_world_size(), 16)
        >>> out = decode(q, k_pages, v_pages, shards=shards, block_table=my_table,
        ...              cache_seqlens=global_lengths, causal=True)
    """
    local = _options(q, k, v, shards, options)
    rank, world = _group_rank(group, shards)
    row, size = _state_bytes(q)
    send = torch.empty(row, dtype=torch.uint8, device=q.device)
    _state_into(send, q, k_cache, v_cache, shards, rank, _step_options(local, k))
    recv = torch.empty((world + (k is not None)) * row, dtype=torch.uint8, device=q.device)
    if k is not None:  # the same on every rank, merged there with no collective; written after the calls
        _new_state_into(recv[world * row:], q, k, v, k_cache.dtype, local)
        _append_step(k_cache, v_cache, k, v, shards, rank, local, local.get("block_table"))
    gathered = recv[:world * row]
    if send.is_cuda and dist.get_backend(group) == dist.Backend.GLOO:  # gloo gathers CPU tensors only
        staged = torch.empty(gathered.shape, dtype=torch.uint8)
        dist.all_gather_into_tensor(staged, send.cpu(), group=group)
        gathered.copy_(staged)
    else:
        dist.all_gather_into_tensor(gathered, send, group=group)
    return _merged(recv.view(-1, row), q, size, return_softmax_lse)


def decode_shards(q: torch.Tensor, k_caches: list[torch.Tensor] | tuple[torch.Tensor, ...],
                  v_caches: list[torch.Tensor] | tuple[torch.Tensor, ...], k: torch.Tensor | None = None,
                  v: torch.Tensor | None = None, *, shards: Shards,
                  block_tables: list[torch.Tensor] | tuple[torch.Tensor, ...] | None = None,
                  return_softmax_lse: bool = False, **options) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode` of every rank's shard in one process, with no collective: ``k_caches[r]``,
    ``v_caches[r]`` (and ``block_tables[r]``) are rank r's, k and v the step's new tokens as there;
    the states are packed, merged and returned as :func:`decode` does, bit for bit. For tests, and for
    shards that fit one device."""
    local = _options(q, k, v, shards, options)
    if not isinstance(k_caches, (list, tuple)) or not isinstance(v_caches, (list, tuple)):
        raise TypeError(f"k_caches and v_caches must be lists of {shards.world_size} tensors, got "
                        f"{type(k_caches).__name__} and {type(v_caches).__name__}")
    tables = [None] * shards.world_size if block_tables is None else block_tables
    for name, x in (("k_caches", k_caches), ("v_caches", v_caches), ("block_tables", tables)):
        if len(x) != shards.world_size:
            raise ValueError(f"{name} must hold one item a rank, {shards.world_size}, got {len(x)}")
    if "block_table" in options:
        raise ValueError("block_table: pass block_tables, one a rank")
    row, size = _state_bytes(q)
    recv = torch.empty(shards.world_size + (k is not None), row, dtype=torch.uint8, device=q.device)
    shard_options = _step_options(local, k)
    for r in range(shards.world_size):
        _state_into(recv[r], q, k_caches[r], v_caches[r], shards, r, dict(shard_options, block_table=tables[r]))
    if k is not None:  # written after every call, as decode does
        _new_state_into(recv[-1], q, k, v, k_caches[0].dtype, local)
        for r in range(shards.world_size):
            _append_step(k_caches[r], v_caches[r], k, v, shards, r, local, tables[r])
    return _merged(recv, q, size, return_softmax_lse)


def local_state(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, shards: Shards, rank: int,
                **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's ``(out, lse)`` over its shard, as :func:`decode` computes it before the gather: for callers
    that run their own collective (an all-to-all by heads, say) and merge with ``merge_states``."""
    local = _options(q, None, None, shards, options)
    shards._check_rank(rank)
    kwargs = _rank_options(local, shards, rank)
    return flash_decode(q, k_cache, v_cache, return_softmax_lse=True, **kwargs)


def merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_states(outs, lses)`` on CUDA tensors; on CPU tensors the same formula in float32 torch
    (for CPU process groups, where flash_decode's kernels do not run)."""
    if outs.is_cuda:
        return merge_states(outs, lses)
    lse = torch.logsumexp(lses, 0)
    weights = torch.exp(lses - lse).nan_to_num(0.0)  # a row of empty states: -inf - -inf
    out = (weights.unsqueeze(-1) * outs.float()).sum(0)
    return out.to(outs.dtype), lse


def append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, shards: Shards,
           rank: int, cache_seqlens: torch.Tensor, block_table: torch.Tensor | None = None,
           cache_batch_idx: torch.Tensor | None = None, k_descale: float | torch.Tensor | None = None,
           v_descale: float | torch.Tensor | None = None) -> None:
    """Write a step's new keys and values (``(batch, seqlen_new, nheads_kv, headdim)``, already rotated
    at their global positions) into rank's shard: token t of sequence b, at global position
    ``cache_seqlens[b] + t``, goes to the rank that holds that position, at its local index; other
    ranks leave their caches as they are. Every rank calls it with the same k, v and lengths. An fp8
    cache stores ``(x / descale)`` saturated, as flash_decode's append does. No host sync; slots past a
    local cache are not written. The caller advances cache_seqlens."""
    shards._check_rank(rank)
    for name, x in (("k", k), ("v", v), ("cache_seqlens", cache_seqlens)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must be (batch, seqlen_new, nheads_kv, headdim) of one shape, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    batch, new = k.shape[:2]
    if cache_seqlens.shape != (batch,):
        raise ValueError(f"cache_seqlens must have shape ({batch},), got {tuple(cache_seqlens.shape)}")
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    seqs = torch.arange(batch, device=k.device)
    rows = seqs if cache_batch_idx is None else cache_batch_idx.long().clamp(0, k_cache.shape[0] - 1)
    for t in range(new):  # one token of each sequence a pass: the sequences' slots are distinct
        position = cache_seqlens.long() + t
        mine = shards.rank_of(position) == rank
        slot = shards.local_index(position).clamp(0, capacity - 1)
        mine &= (position >= 0) & (shards.local_index(position) < capacity)  # in the shard, as flash_decode skips
        if paged:  # nor a page id outside the pool
            page = block_table[seqs, slot // k_cache.shape[1]].long()
            mine &= (page >= 0) & (page < k_cache.shape[0])
            index = (page.clamp(0, k_cache.shape[0] - 1), slot % k_cache.shape[1])
        else:
            index = (rows, slot)
        for cache, x, descale in ((k_cache, k, k_descale), (v_cache, v, v_descale)):
            bits = cache.view(_BITS[cache.element_size()])  # where() on the bits: any dtype, fp8 too
            value = _stored(x[:, t], cache.dtype, descale).view(bits.dtype)
            bits[index] = torch.where(mine.view(-1, 1, 1), value, bits[index])


def _stored(x, dtype, descale):
    """x (batch, ..., nheads_kv, headdim) as a cache of dtype stores it."""
    if dtype not in _FP8_MAX:
        return x.to(dtype)
    scale = 1.0 if descale is None else descale
    if isinstance(scale, torch.Tensor):  # 1 element, or (batch, nheads_kv)
        ones = [1] * (x.dim() - 3)
        scale = scale.view([1] * x.dim()) if scale.numel() == 1 else scale.view(x.shape[0], *ones, x.shape[-2], 1)
    return (x.float() / scale).clamp(-_FP8_MAX[dtype], _FP8_MAX[dtype]).to(dtype)


def _group_rank(group, shards):
    """This process's rank and the group's size, checked against shards."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("group: torch.distributed is not initialized (call init_process_group first)")
    world = dist.get_world_size(group)
    if world != shards.world_size:
        raise ValueError(f"shards must be for the group's {world} ranks, got world_size={shards.world_size}")
    return dist.get_rank(group), world


# Why each refused option needs a key's global position (the message names the option).
_POSITIONAL = {
    "alibi_slopes": "ALiBi adds -slope * |p - j| for global key positions j",
    "rotary_cos": "rotary rotates at the local length", "rotary_sin": "rotary rotates at the local length",
}


def _options(q, k, v, shards, options):
    """options checked for a sharded call, with the whole-sequence (global) lengths still to map."""
    if not isinstance(shards, Shards):
        raise TypeError(f"shards must be a flash_decode.distributed.Shards, got {type(shards).__name__}")
    for name in ("cu_seqlens_q", "max_seqlen_q"):
        if options.get(name) is not None:
            raise NotImplementedError(f"{name}: a sharded call takes uniform query rows (batch, seqlen_q, ...); "
                                      "pad ragged ones to the longest")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a tensor (batch, seqlen_q, nheads_q, headdim), got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both or neither")
    if k is not None:
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4 or k.shape != v.shape:
            raise ValueError("k, v must be tensors (batch, seqlen_new, nheads_kv, headdim) of one shape")
        if not isinstance(options.get("cache_seqlens"), (int, torch.Tensor)):
            raise ValueError("cache_seqlens: with k, v, the keys cached before them (an int or a tensor)")
    if "out" in options:
        raise TypeError("out: a sharded call writes into its own gather buffer")
    seqlen_q = q.shape[1]
    for name, why in _POSITIONAL.items():
        if options.get(name) is not None:
            raise NotImplementedError(f"{name}: {why}, and a shard's flash_decode call numbers its keys from 0 "
                                      "(the kernels take no key position offset and stride): decode on one GPU")
    left, right = _pair(options.get("window_size", (-1, -1)))
    if left != -1 or (right != -1 and seqlen_q > 1):
        raise NotImplementedError(f"window_size={(left, right)}: a window bounds keys by their global positions, "
                                  "and a shard's flash_decode call numbers its keys from 0 (the kernels take "
                                  "no key position offset and stride); only (-1, -1), or (-1, right) with "
                                  "seqlen_q 1, is exact")
    if options.get("causal") and seqlen_q > (0 if k is None else k.shape[1]) and seqlen_q > 1:
        raise NotImplementedError(f"causal: with seqlen_q={seqlen_q} each query row sees keys up to its global "
                                  "position, and a shard's call masks its own last keys instead (the kernels "
                                  "take no key position offset and stride); pass the step's new tokens as k, v "
                                  "(at least seqlen_q of them), whose causal block is merged separately")
    return dict(options)


def _step_options(options, k):
    """The shard calls' options: with new tokens, the cached keys alone, which every query row sees."""
    return options if k is None else dict(options, causal=False)


def _append_step(k_cache, v_cache, k, v, shards, rank, options, block_table):
    """append of the step's new tokens into rank's shard, at the global lengths the options give."""
    lengths = options["cache_seqlens"]
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.full((k.shape[0],), lengths, dtype=torch.int32, device=k.device)
    append(k_cache, v_cache, k, v, shards=shards, rank=rank, cache_seqlens=lengths, block_table=block_table,
           cache_batch_idx=options.get("cache_batch_idx"), k_descale=options.get("k_descale"),
           v_descale=options.get("v_descale"))


def _new_state_into(row, q, k, v, cache_dtype, options):
    """Every query row's (out, lse) over the step's new tokens alone, written into row: a cache of
    seqlen_new keys stored as the shards store them, causal (bottom-right) as in the whole cache."""
    out, lse = _views(row, q, _state_bytes(q)[1])
    keys, values = (_stored(x, cache_dtype, options.get(f"{n}_descale")) for n, x in (("k", k), ("v", v)))
    names = ("softmax_scale", "causal", "softcap", "batch_invariant", "k_descale", "v_descale")
    kwargs = {n: options[n] for n in names if options.get(n) is not None}
    _, got = flash_decode(q, keys, values, return_softmax_lse=True, out=out, **kwargs)
    lse.copy_(got)


def _pair(window):
    """window_size's two sides, or (-1, -1) for a value flash_decode itself refuses by name."""
    return tuple(window) if isinstance(window, (tuple, list)) and len(window) == 2 else (-1, -1)


def _rank_options(options, shards, rank):
    """flash_decode's keywords for rank's shard: lengths and bounds mapped to local ones, sinks on rank 0."""
    kwargs = dict(options)
    for name in ("cache_seqlens", "cache_leftpad"):
        if kwargs.get(name) is not None:
            kwargs[name] = shards.local_length(kwargs[name], rank)
    if isinstance(kwargs.get("cache_seqlens"), torch.Tensor):
        kwargs["cache_seqlens"] = kwargs["cache_seqlens"].to(torch.int32)
    if isinstance(kwargs.get("cache_leftpad"), torch.Tensor):
        kwargs["cache_leftpad"] = kwargs["cache_leftpad"].to(torch.int32)
    if type(kwargs.get("max_seqlen_k")) is int and kwargs["max_seqlen_k"] >= 0:
        kwargs["max_seqlen_k"] = max(1, shards.local_length(kwargs["max_seqlen_k"], rank))
    if rank != 0:
        kwargs.pop("sinks", None)  # the merge adds the shards' sums: the sink's term counts once
    return kwargs


def _state_bytes(q):
    """Bytes of one rank's packed (out, lse), rounded up to _ALIGN, and out's."""
    batch, seqlen_q, heads, headdim = q.shape
    out_bytes = batch * seqlen_q * heads * headdim * q.element_size()
    row = out_bytes + batch * heads * seqlen_q * 4
    return -(-row // _ALIGN) * _ALIGN, out_bytes


def _state_into(row, q, k_cache, v_cache, shards, rank, options):
    """Rank's (out, lse) over its shard written into row, a uint8 buffer of _state_bytes(q)[0]."""
    out, lse = _views(row, q, _state_bytes(q)[1])
    kwargs = _rank_options(options, shards, rank)
    _, got = flash_decode(q, k_cache, v_cache, return_softmax_lse=True, out=out, **kwargs)
    lse.copy_(got)


def _views(buffer, q, out_bytes):
    """out (..., batch, seqlen_q, nheads_q, headdim) and lse (..., batch, nheads_q, seqlen_q) inside buffer's
    last dimension of bytes."""
    batch, seqlen_q, heads, headdim = q.shape
    lead = buffer.shape[:-1]
    out = buffer[..., :out_bytes].view(q.dtype).view(*lead, batch, seqlen_q, heads, headdim)
    lse_bytes = batch * heads * seqlen_q * 4
    lse = buffer[..., out_bytes:out_bytes + lse_bytes].view(torch.float32).view(*lead, batch, heads, seqlen_q)
    return out, lse


def _merged(states, q, out_bytes, return_softmax_lse):
    """The merge of packed states (world, row bytes): out (batch, seqlen_q, nheads_q, headdim) and lse
    (batch, nheads_q, seqlen_q)."""
    outs, lses = _views(states, q, out_bytes)
    out, lse = merge(outs, lses.transpose(-1, -2))
    return (out, lse.transpose(-1, -2)) if return_softmax_lse else out
