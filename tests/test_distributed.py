"""flash_decode.distributed: the shard layouts' position math (pure, CPU); the append into the rank
that holds a position; the per-rank options (lengths mapped, sinks once, position-dependent options
refused by name); decode_shards and the gloo collective path on CPU processes with a plain-torch
stand-in for flash_decode and the CPU merge; and on a GPU the real kernels: shards decoded in one
process against the whole-cache call, the collective path's packing bit-compared with merge_states,
a world of 1 over NCCL, worlds of 2-3 processes over gloo on one GPU, and NCCL over 2+ GPUs."""

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flash_decode
from flash_decode import distributed as fdist
from flash_decode.distributed import Shards

LAYOUTS = [Shards.contiguous(3, 7), Shards.interleaved(3), Shards.pages(3, 4), Shards.pages(2, 16),
           Shards.interleaved(1), Shards.contiguous(2, 1)]
IDS = [f"w{s.world_size}b{s.block}" for s in LAYOUTS]


# ---- the position math --------------------------------------------------------------

def owners(shards, n):
    """Each rank's global positions below n, in order, by brute force."""
    held = [[] for _ in range(shards.world_size)]
    for j in range(n):
        held[shards.rank_of(j)].append(j)
    return held


@pytest.mark.parametrize("shards", LAYOUTS, ids=IDS)
def test_positions_map_one_to_one(shards):
    n = 5 * shards.world_size * shards.block + 3
    held = owners(shards, n)
    assert sorted(j for rank in held for j in rank) == list(range(n))
    for rank, positions in enumerate(held):
        for i, j in enumerate(positions):
            assert shards.local_index(j) == i and shards.global_position(rank, i) == j
        assert shards.positions(rank, len(positions)).tolist() == positions
        for length in range(n + 1):
            assert shards.local_length(length, rank) == sum(j < length for j in positions)


@pytest.mark.parametrize("shards", LAYOUTS, ids=IDS)
def test_tensors_map_as_ints_do(shards):
    lengths = torch.tensor([0, 1, 5, 16, 17, 40, 97, -3], dtype=torch.int32)
    for rank in range(shards.world_size):
        want = [shards.local_length(max(0, int(n)), rank) for n in lengths]
        assert shards.local_length(lengths, rank).tolist() == want
    j = torch.arange(100)
    assert shards.rank_of(j).tolist() == [shards.rank_of(int(x)) for x in j]
    assert shards.local_index(j).tolist() == [shards.local_index(int(x)) for x in j]


def test_named_layouts():
    assert Shards.contiguous(4, 100).local_length(250, 2) == 50 and Shards.contiguous(4, 100).rank_of(399) == 3
    assert Shards.interleaved(4) == Shards(4, 1) and Shards.interleaved(4).rank_of(6) == 2
    assert Shards.pages(2, 4).local_length(10, 0) == 6 and Shards.pages(2, 4).local_length(10, 1) == 4
    assert repr(Shards.pages(8, 16)) == "Shards(world_size=8, block=16)"


def test_shard_takes_a_ranks_keys():
    x = torch.arange(2 * 11).view(2, 11)
    s = Shards.interleaved(3)
    assert s.shard(x, 1).tolist() == [[1, 4, 7, 10], [12, 15, 18, 21]]
    assert s.shard(x, 2, length=6).tolist() == [[2, 5], [13, 16]]


@pytest.mark.parametrize("args, exc, name", [((0, 1), ValueError, "world_size"), ((2, 0), ValueError, "block"),
                                             ((2.0, 1), TypeError, "world_size"), ((2, "4"), TypeError, "block")])
def test_bad_layouts_are_refused(args, exc, name):
    with pytest.raises(exc, match=f"^{name}"):
        Shards(*args)


def test_bad_ranks_and_lengths_are_refused():
    s = Shards.interleaved(2)
    for rank in (2, -1, 1.0):
        with pytest.raises(ValueError, match="^rank"):
            s.local_length(4, rank)
    with pytest.raises(ValueError, match="^length"):
        s.local_length(-1, 0)


# ---- a plain-torch flash_decode for CPU tensors --------------------------------------

def standin(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
            block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            return_softmax_lse=False, out=None, max_seqlen_k=None, num_splits=0, batch_invariant=False,
            k_descale=None, v_descale=None, sinks=None):
    """flash_decode's answer in float32 torch for the options a sharded call passes on."""
    assert k is None and v is None and window_size == (-1, -1)
    if block_table is not None:
        k_cache, v_cache = (x[block_table.long()].flatten(1, 2) for x in (k_cache, v_cache))
    elif cache_batch_idx is not None:
        k_cache, v_cache = k_cache[cache_batch_idx.long()], v_cache[cache_batch_idx.long()]
    b, sq, hq, d = q.shape
    keys = k_cache.shape[1]
    lens = torch.full((b,), keys) if cache_seqlens is None else torch.as_tensor(cache_seqlens).expand(b)
    lens = lens.long().clamp(0, keys).view(b, 1, 1)
    pad = torch.zeros(b, 1, 1, dtype=torch.long) if cache_leftpad is None else cache_leftpad.long().view(b, 1, 1)
    j = torch.arange(keys).view(1, 1, -1)
    mask = (j >= pad) & (j < lens)
    if causal:
        mask = mask & (j <= lens - sq + torch.arange(sq).view(1, -1, 1))
    group = hq // k_cache.shape[2]
    kf, vf = (x.float().repeat_interleave(group, 2) * (1.0 if s is None else s)
              for x, s in ((k_cache, k_descale), (v_cache, v_descale)))
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask.unsqueeze(1), -math.inf)
    every = scores if sinks is None else torch.cat([scores, sinks.view(1, -1, 1, 1).expand(b, hq, sq, 1)], -1)
    lse = torch.logsumexp(every, -1)                                     # (b, hq, sq)
    p = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    result = torch.einsum("bhqk,bkhd->bqhd", p, vf).to(q.dtype)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_softmax_lse else result


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(fdist, "flash_decode", standin)


def problem(shards, seed=0, batch=3, heads=(4, 2), headdim=16, dtype=torch.float32, device="cpu", paged=0,
            kv_dtype=None):
    """q, the whole caches, global lengths, and each rank's shard (paged: its own pool of shuffled pages
    of that size and its block table), the same from the same seed in every process."""
    g = torch.Generator().manual_seed(seed)  # drawn and sharded on the CPU, then moved (fp8 too)
    keys = 4 * shards.world_size * shards.block + 5
    q = torch.randn(batch, 1, heads[0], headdim, generator=g).to(device, dtype)
    k, v = (torch.randn(batch, keys, heads[1], headdim, generator=g) for _ in "kv")
    lengths = torch.randint(0, keys + 1, (batch,), generator=g, dtype=torch.int32)
    lengths[0] = keys
    ranks = []
    for r in range(shards.world_size):
        kr, vr = (shards.shard(x, r) for x in (k, v))
        if paged:
            blocks = -(-kr.shape[1] // paged)
            kr, vr = (torch.cat([x, x.new_zeros(batch, blocks * paged - x.shape[1], *x.shape[2:])], 1)
                      .view(batch * blocks, paged, *x.shape[2:]) for x in (kr, vr))
            order = torch.randperm(batch * blocks, generator=g)
            kr, vr = kr[order].contiguous(), vr[order].contiguous()
            table = torch.argsort(order).view(batch, blocks).to(device, torch.int32)
        else:
            table = None
        ranks.append((kr.to(device, kv_dtype or dtype), vr.to(device, kv_dtype or dtype), table))
    k, v = (x.to(device, kv_dtype or dtype) for x in (k, v))
    return q, k, v, lengths.to(device), ranks


def whole(q, k, v, **options):
    return standin(q, k, v, return_softmax_lse=True, **options)


CPU_OPTIONS = [dict(), dict(sinks=True), dict(softcap=2.0, causal=True), dict(leftpad=True), dict(int_length=True),
               dict(softmax_scale=0.3, max_seqlen_k=True)]


def cpu_options(case, q, lengths):
    options = dict(case)
    if options.pop("sinks", False):
        options["sinks"] = torch.linspace(-1.0, 2.0, q.shape[2])
    if options.pop("leftpad", False):
        options["cache_leftpad"] = (lengths // 3).to(torch.int32)
    options["cache_seqlens"] = int(lengths[0]) - 2 if options.pop("int_length", False) else lengths
    if options.pop("max_seqlen_k", False):
        options["max_seqlen_k"] = int(lengths.max())
    return options


@pytest.mark.parametrize("case", CPU_OPTIONS, ids=lambda c: ",".join(c) or "plain")
@pytest.mark.parametrize("shards", LAYOUTS[:4], ids=IDS[:4])
@pytest.mark.parametrize("paged", [0, 4])
def test_shards_merge_into_the_whole_cache(on_cpu, shards, case, paged):
    q, k, v, lengths, ranks = problem(shards, paged=paged)
    options = cpu_options(case, q, lengths)
    want_out, want_lse = whole(q, k, v, **{n: x for n, x in options.items() if n != "max_seqlen_k"})
    out, lse = fdist.decode_shards(q, [r[0] for r in ranks], [r[1] for r in ranks], shards=shards,
                                   block_tables=[r[2] for r in ranks] if paged else None,
                                   return_softmax_lse=True, **options)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_sinks_reach_rank_0_only(monkeypatch):
    calls = []
    monkeypatch.setattr(fdist, "flash_decode", lambda *a, **kw: calls.append(kw) or standin(*a, **kw))
    shards = Shards.interleaved(3)
    q, k, v, lengths, ranks = problem(shards)
    sinks = torch.zeros(q.shape[2])
    fdist.decode_shards(q, [r[0] for r in ranks], [r[1] for r in ranks], shards=shards, sinks=sinks,
                        cache_seqlens=lengths)
    assert [c.get("sinks") is sinks for c in calls] == [True, False, False]
    assert [c["cache_seqlens"].tolist() for c in calls] == [shards.local_length(lengths, r).tolist()
                                                            for r in range(3)]


def test_gqa_and_empty_sequences(on_cpu):
    shards = Shards.pages(2, 4)
    q, k, v, lengths, ranks = problem(shards, heads=(6, 1))
    lengths[1] = 0
    out, lse = fdist.decode_shards(q, [r[0] for r in ranks], [r[1] for r in ranks], shards=shards,
                                   cache_seqlens=lengths, return_softmax_lse=True)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    torch.testing.assert_close(out, whole(q, k, v, cache_seqlens=lengths)[0], atol=1e-5, rtol=1e-5)


def test_cpu_merge_is_merge_states_formula():
    outs, lses = torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5)
    lses[:, 1, 2] = -math.inf
    lses[1, 0, 0] = -math.inf
    out, lse = fdist.merge(outs, lses)
    torch.testing.assert_close(lse[0], torch.logsumexp(lses[:, 0], 0))
    torch.testing.assert_close(out[0], (torch.softmax(lses[:, 0], 0).unsqueeze(-1) * outs[:, 0]).sum(0))
    assert torch.isneginf(lse[1, 2]) and (out[1, 2] == 0).all()


# ---- refusals --------------------------------------------------------------------------

REFUSED = [
    ("alibi_slopes", dict(alibi_slopes=torch.ones(4)), 1, NotImplementedError),
    ("window_size", dict(window_size=(8, -1)), 1, NotImplementedError),
    ("window_size", dict(window_size=(-1, 0)), 2, NotImplementedError),
    ("causal", dict(causal=True), 2, NotImplementedError),
    ("rotary_cos", dict(rotary_cos=torch.ones(4, 8)), 1, NotImplementedError),
    ("out", dict(out=torch.empty(1)), 1, TypeError),
    ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32), max_seqlen_q=1), 1,
     NotImplementedError),
]


@pytest.mark.parametrize("name, options, seqlen_q, exc", REFUSED, ids=[f"{r[0]}-sq{r[2]}" for r in REFUSED])
def test_position_dependent_options_are_refused_by_name(on_cpu, name, options, seqlen_q, exc):
    shards = Shards.interleaved(2)
    _, _, _, lengths, ranks = problem(shards)
    q = torch.randn(3, seqlen_q, 4, 16)
    with pytest.raises(exc, match=f"^{name}") as err:
        fdist.decode_shards(q, [r[0] for r in ranks], [r[1] for r in ranks], shards=shards, **options)
    if exc is NotImplementedError and name != "cu_seqlens_q":
        assert "position" in str(err.value)


@pytest.mark.parametrize("new, options, exc, name", [
    ((1, None), dict(cache_seqlens=3), ValueError, "k, v"), ((1, 1), dict(), ValueError, "cache_seqlens"),
    ((2, 2), dict(cache_seqlens=3, causal=True), NotImplementedError, "causal")])
def test_new_tokens_are_checked_before_the_group_is_asked_for(on_cpu, new, options, exc, name):
    shards = Shards.interleaved(2)
    _, _, _, _, ranks = problem(shards)
    q = torch.randn(3, 3, 4, 16)
    k, v = (None if n is None else torch.randn(3, n, 2, 16) for n in new)
    with pytest.raises(exc, match=f"^{name}"):
        fdist.decode(q, ranks[0][0], ranks[0][1], k, v, shards=shards, **options)


@pytest.mark.parametrize("seqlen_q, new, causal", [(1, 1, True), (3, 3, True), (2, 4, True), (3, 3, False)])
@pytest.mark.parametrize("shards", [Shards.pages(3, 4), Shards.interleaved(2)], ids=["pages3x4", "interleaved2"])
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_new_tokens_in_the_call_attend_as_in_the_whole_cache(on_cpu, shards, seqlen_q, new, causal, kv_dtype):
    """Speculative tokens: the shards' cached keys and the new tokens' own (causal) block, merged, are the
    whole cache's call with k, v appended; afterwards each shard holds its new tokens."""
    q, k_whole, v_whole, lengths, ranks = problem(shards, kv_dtype=kv_dtype)
    capacity = k_whole.shape[1]
    lengths = lengths.clamp(max=capacity - new)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(q.shape[0], seqlen_q, *q.shape[2:], generator=g)
    k, v = (torch.randn(q.shape[0], new, k_whole.shape[2], q.shape[3], generator=g) for _ in "kv")
    descale = dict(k_descale=0.5, v_descale=2.0) if kv_dtype else {}
    for b, n in enumerate(lengths.tolist()):
        k_whole[b, n:n + new] = fdist._stored(k[b], k_whole.dtype, descale.get("k_descale"))
        v_whole[b, n:n + new] = fdist._stored(v[b], v_whole.dtype, descale.get("v_descale"))
    want = whole(q, k_whole, v_whole, cache_seqlens=lengths + new, causal=causal, **descale)
    out, lse = fdist.decode_shards(q, [r[0] for r in ranks], [r[1] for r in ranks], k, v, shards=shards,
                                   cache_seqlens=lengths, causal=causal, return_softmax_lse=True, **descale)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want[1], atol=1e-5, rtol=1e-5)
    for r, (kr, vr, _) in enumerate(ranks):
        assert torch.equal(kr.view(torch.uint8), shards.shard(k_whole, r).view(torch.uint8))
        assert torch.equal(vr.view(torch.uint8), shards.shard(v_whole, r).view(torch.uint8))


def test_decode_needs_an_initialized_group():
    shards = Shards.interleaved(1)
    q, _, _, _, ranks = problem(shards)
    with pytest.raises(RuntimeError, match="^group"):
        fdist.decode(q, ranks[0][0], ranks[0][1], shards=shards)
    with pytest.raises(TypeError, match="^shards"):
        fdist.decode(q, ranks[0][0], ranks[0][1], shards=2)


def test_decode_shards_checks_its_lists(on_cpu):
    shards = Shards.interleaved(2)
    q, _, _, _, ranks = problem(shards)
    with pytest.raises(ValueError, match="^k_caches"):
        fdist.decode_shards(q, [ranks[0][0]], [ranks[0][1]], shards=shards)
    with pytest.raises(TypeError, match="^k_caches"):
        fdist.decode_shards(q, ranks[0][0], ranks[0][1], shards=shards)
    with pytest.raises(ValueError, match="^block_table"):
        fdist.decode_shards(q, [r[0] for r in ranks], [r[1] for r in ranks], shards=shards, block_table=None)


def test_local_state_is_one_ranks_call(on_cpu):
    shards = Shards.contiguous(2, 9)
    q, _, _, lengths, ranks = problem(shards)
    out, lse = fdist.local_state(q, ranks[1][0], ranks[1][1], shards=shards, rank=1, cache_seqlens=lengths)
    want = standin(q, ranks[1][0], ranks[1][1], cache_seqlens=shards.local_length(lengths, 1),
                   return_softmax_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


# ---- append --------------------------------------------------------------------------

@pytest.mark.parametrize("shards", LAYOUTS[:4], ids=IDS[:4])
@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("paged", [0, 4])
@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_append_writes_each_token_into_its_owner(shards, new, paged, kv_dtype):
    batch, heads, d = 3, 2, 8
    g = torch.Generator().manual_seed(1)
    capacity = 6 * shards.world_size * shards.block
    whole_k = torch.zeros(batch, capacity, heads, d, dtype=kv_dtype)
    lengths = torch.tensor([0, 5, capacity - new - 1], dtype=torch.int32)
    k = torch.randn(batch, new, heads, d, generator=g).half()
    descale = 0.5 if kv_dtype != torch.float16 else None
    for b in range(batch):  # the whole cache after a flash_decode append of k
        whole_k[b, lengths[b]:lengths[b] + new] = fdist._stored(k[b], kv_dtype, descale)
    for r in range(shards.world_size):
        local = torch.zeros(batch, shards.local_length(capacity, r), heads, d, dtype=kv_dtype)
        table = None
        if paged:
            blocks = -(-local.shape[1] // paged)
            local = torch.zeros(batch * blocks, paged, heads, d, dtype=kv_dtype)
            table = torch.randperm(batch * blocks, generator=g).view(batch, blocks).to(torch.int32)
        other = local.clone()
        fdist.append(local, other, k, k, shards=shards, rank=r, cache_seqlens=lengths, block_table=table,
                     k_descale=descale, v_descale=descale)
        local, other = local.view(torch.uint8), other.view(torch.uint8)  # torch < 2.10 cannot index fp8
        if paged:
            local = local[table.long()].flatten(1, 2)[:, :shards.local_length(capacity, r)]
            other = other[table.long()].flatten(1, 2)[:, :shards.local_length(capacity, r)]
        want = shards.shard(whole_k, r).view(torch.uint8)
        assert torch.equal(local, want)
        assert torch.equal(other, want)


def test_append_follows_cache_batch_idx_and_skips_past_the_shard():
    shards = Shards.interleaved(2)
    cache = torch.zeros(3, 2, 1, 4)
    k = torch.ones(2, 1, 1, 4)
    fdist.append(cache, cache.clone(), k, k, shards=shards, rank=0, cache_seqlens=torch.tensor([2, 4]),
                 cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))
    assert cache[2, 1].eq(1).all() and cache[0].eq(0).all() and cache[1].eq(0).all()  # position 4: local 2, past


@pytest.mark.parametrize("shards", [Shards.pages(3, 4), Shards.interleaved(2)], ids=["pages3x4", "interleaved2"])
def test_steps_of_append_then_decode_follow_the_whole_cache(on_cpu, shards):
    """An engine's loop: each step appends a token of every sequence into its owner, then decodes."""
    batch, heads, d, capacity, steps = 2, 2, 8, 64, 9
    g = torch.Generator().manual_seed(5)
    whole_k, whole_v = torch.zeros(batch, capacity, heads, d), torch.zeros(batch, capacity, heads, d)
    local = [[torch.zeros(batch, shards.local_length(capacity, r), heads, d) for _ in "kv"]
             for r in range(shards.world_size)]
    lengths = torch.tensor([3, 0], dtype=torch.int32)
    for b in range(batch):  # a prefilled prompt, loaded shard by shard
        whole_k[b, :lengths[b]], whole_v[b, :lengths[b]] = (torch.randn(int(lengths[b]), heads, d, generator=g)
                                                            for _ in "kv")
    for r, (kr, vr) in enumerate(local):
        kr.copy_(shards.shard(whole_k, r))
        vr.copy_(shards.shard(whole_v, r))
    for _ in range(steps):
        q = torch.randn(batch, 1, 4, d, generator=g)
        k, v = (torch.randn(batch, 1, heads, d, generator=g) for _ in "kv")
        for b in range(batch):
            whole_k[b, lengths[b]], whole_v[b, lengths[b]] = k[b, 0], v[b, 0]
        for r, (kr, vr) in enumerate(local):
            fdist.append(kr, vr, k, v, shards=shards, rank=r, cache_seqlens=lengths)
        lengths += 1
        out = fdist.decode_shards(q, [x[0] for x in local], [x[1] for x in local], shards=shards,
                                  cache_seqlens=lengths, causal=True)
        torch.testing.assert_close(out, standin(q, whole_k, whole_v, cache_seqlens=lengths), atol=1e-5, rtol=1e-5)


# ---- the collective path over gloo, CPU processes ------------------------------------

def _gloo_worker(rank, world, init, block, paged, new, results):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        fdist.flash_decode = standin
        shards = Shards(world, block)
        q, k, v, lengths, ranks = problem(shards, seed=7, paged=paged)
        lengths = lengths.clamp(max=k.shape[1] - new)
        q = q.expand(-1, max(new, 1), -1, -1).contiguous()
        k_new, v_new = (x[:, :new] * 0.5 for x in (k, v)) if new else (None, None)
        sinks = torch.linspace(-1.0, 1.0, q.shape[2])
        options = dict(cache_seqlens=lengths, sinks=sinks, softcap=3.0, causal=bool(new), return_softmax_lse=True)
        theirs = [(kr.clone(), vr.clone(), t) for kr, vr, t in ranks]
        kr, vr, table = ranks[rank]
        out, lse = fdist.decode(q, kr, vr, k_new, v_new, shards=shards, block_table=table, **options)
        local = fdist.decode_shards(q, [r[0] for r in theirs], [r[1] for r in theirs], k_new, v_new, shards=shards,
                                    block_tables=[r[2] for r in theirs] if paged else None, **options)
        assert torch.equal(out, local[0]) and torch.equal(lse, local[1]), "gathered and local merges differ"
        assert torch.equal(kr, theirs[rank][0]) and torch.equal(vr, theirs[rank][1]), "appends differ"
        for b, n in enumerate(lengths.tolist()):
            if new:
                k[b, n:n + new], v[b, n:n + new] = k_new[b], v_new[b]
        want = whole(q, k, v, cache_seqlens=lengths + new, sinks=sinks, softcap=3.0, causal=bool(new))
        torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, want[1], atol=1e-5, rtol=1e-5)
        results.put(rank)
    finally:
        dist.destroy_process_group()


def spawn(worker, world, *args):
    """Run worker(rank, world, init, *args, results) in world spawned processes; the ranks that finished."""
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.get_context("spawn").SimpleQueue()
        mp.spawn(worker, args=(world, f"file://{os.path.join(tmp, 'store')}", *args, results), nprocs=world)
        done = []
        while not results.empty():
            done.append(results.get())
        return sorted(done)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo in this torch")
@pytest.mark.parametrize("world, block, paged, new", [(2, 1, 0, 0), (3, 4, 4, 0), (3, 5, 0, 0), (2, 4, 4, 3)])
def test_gloo_gathers_and_merges_on_cpu_processes(world, block, paged, new):
    assert spawn(_gloo_worker, world, block, paged, new) == list(range(world))


# ---- on a GPU: the real kernels --------------------------------------------------------

GPU_OPTIONS = [dict(), dict(causal=True, sinks=True), dict(softcap=5.0), dict(fp8=True), dict(batch_invariant=True)]


def gpu_problem(shards, dtype, case, paged):
    kv_dtype = torch.float8_e4m3fn if case.get("fp8") else None
    q, k, v, lengths, ranks = problem(shards, seed=3, batch=4, heads=(16, 4), headdim=128, dtype=dtype,
                                      device="cuda", paged=paged, kv_dtype=kv_dtype)
    options = {n: x for n, x in case.items() if n not in ("fp8", "sinks")}
    options["cache_seqlens"] = lengths
    if case.get("sinks"):
        options["sinks"] = torch.linspace(-1.0, 3.0, q.shape[2], device="cuda")
    if kv_dtype is not None:
        options.update(k_descale=0.5, v_descale=0.25)
    return q, k, v, ranks, options


@pytest.mark.cuda
@pytest.mark.parametrize("case", GPU_OPTIONS, ids=lambda c: ",".join(c) or "plain")
@pytest.mark.parametrize("shards", [Shards.contiguous(3, 96), Shards.interleaved(4), Shards.pages(2, 16)],
                         ids=["contiguous3", "interleaved4", "pages2x16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_shards_match_the_whole_cache_call(shards, dtype, case):
    from conftest import LSE_TOL, OUT_TOL
    paged = 16 if shards.block == 16 else 0
    q, k, v, ranks, options = gpu_problem(shards, dtype, case, paged)
    want_out, want_lse = flash_decode.flash_decode(q, k, v, return_softmax_lse=True, **options)
    out, lse = fdist.decode_shards(q, [r[0] for r in ranks], [r[1] for r in ranks], shards=shards,
                                   block_tables=[r[2] for r in ranks] if paged else None,
                                   return_softmax_lse=True, **options)
    torch.testing.assert_close(out, want_out, **OUT_TOL[dtype])
    torch.testing.assert_close(lse, want_lse, **LSE_TOL[dtype])
    # The collective path's packing and merge, bit for bit against merge_states of each rank's state.
    states = [fdist.local_state(q, kr, vr, shards=shards, rank=r, block_table=t, **options)
              for r, (kr, vr, t) in enumerate(ranks)]
    direct = flash_decode.merge_states([s[0] for s in states], [s[1].transpose(1, 2) for s in states])
    assert torch.equal(out, direct[0]) and torch.equal(lse, direct[1].transpose(1, 2))


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["fp16", "fp8"])
@pytest.mark.parametrize("shards", [Shards.interleaved(3), Shards.pages(2, 16)], ids=["interleaved3", "pages2x16"])
def test_gpu_new_tokens_match_the_whole_cache_call(shards, fp8):
    """Three speculative rows, causal, with their three tokens appended in the call: the shards' answer and
    caches against flash_decode's append and attention over the whole cache."""
    from conftest import LSE_TOL, OUT_TOL
    paged, rows = (16 if shards.block == 16 else 0), 3
    q, k_whole, v_whole, ranks, options = gpu_problem(shards, torch.float16, dict(fp8=True) if fp8 else {}, paged)
    options["cache_seqlens"] = options["cache_seqlens"].clamp(max=k_whole.shape[1] - rows)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(q.shape[0], rows, *q.shape[2:], generator=g).to("cuda", torch.float16)
    k, v = (torch.randn(q.shape[0], rows, k_whole.shape[2], q.shape[3], generator=g).to("cuda", torch.float16)
            for _ in "kv")
    want = flash_decode.flash_decode(q, k_whole, v_whole, k, v, causal=True, return_softmax_lse=True, **options)
    out, lse = fdist.decode_shards(q, [r[0] for r in ranks], [r[1] for r in ranks], k, v, shards=shards,
                                   block_tables=[r[2] for r in ranks] if paged else None, causal=True,
                                   return_softmax_lse=True, **options)
    torch.testing.assert_close(out, want[0], **OUT_TOL[torch.float16])
    torch.testing.assert_close(lse, want[1], **LSE_TOL[torch.float16])
    for r, (kr, _, table) in enumerate(ranks):  # compared as bytes: fp8 is not indexed on the device
        local = kr.view(torch.uint8)
        if table is not None:
            local = local[table.long()].flatten(1, 2)[:, :shards.local_length(k_whole.shape[1], r)]
        assert torch.equal(local, shards.shard(k_whole.view(torch.uint8), r))


def _gpu_worker(rank, world, init, backend, results):
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        shards = Shards.pages(world, 16)
        q, k, v, ranks, options = gpu_problem(shards, torch.float16, dict(sinks=True, causal=True), 16)
        kr, vr, table = ranks[rank]
        out, lse = fdist.decode(q, kr, vr, shards=shards, block_table=table, return_softmax_lse=True, **options)
        local = fdist.decode_shards(q, [r[0] for r in ranks], [r[1] for r in ranks], shards=shards,
                                    block_tables=[r[2] for r in ranks], return_softmax_lse=True, **options)
        if torch.cuda.device_count() == 1 or backend == "nccl" and world == 1:  # one GPU model: the same bits
            assert torch.equal(out, local[0]) and torch.equal(lse, local[1]), "gathered and local merges differ"
        want_out, want_lse = flash_decode.flash_decode(q, k, v, return_softmax_lse=True, **options)
        torch.testing.assert_close(out, want_out, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=1e-3)
        results.put(rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.parametrize("backend, world", [("nccl", 1), ("gloo", 2), ("gloo", 3)])
def test_gpu_collective_path_on_one_gpu(backend, world):
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("no NCCL in this torch")
    assert spawn(_gpu_worker, world, backend) == list(range(world))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs")
def test_gpu_nccl_over_every_gpu():
    world = min(torch.cuda.device_count(), 8)
    assert spawn(_gpu_worker, world, "nccl") == list(range(world))


# ---- dev/cp_bench.py: its arguments (the benchmark itself runs under torchrun on GPUs) ----

@pytest.fixture(scope="module")
def cp_bench():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parent.parent / "dev" / "cp_bench.py"
    spec = importlib.util.spec_from_file_location("cp_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cp_bench_arguments(cp_bench):
    args = cp_bench.parse_args([])
    assert args.lengths == [32768, 131072, 1 << 20] and args.batch == [1] and args.heads == (32, 8)
    assert args.layout == ("interleaved", 0) and args.layers == 4 and not args.no_single and args.out is None
    assert not args.append and cp_bench.parse_args(["--append"]).append
    args = cp_bench.parse_args(["--lengths", "1k,3", "--batch", "1,8", "--heads", "8/1", "--layout", "pages16",
                                "--layers", "80", "--dtype", "bf16", "--no-single", "--out", "/tmp/cp"])
    assert args.lengths == [1024, 3] and args.batch == [1, 8] and args.heads == (8, 1)
    assert args.layout == ("pages", 16) and args.layers == 80 and args.dtype == "bf16" and args.no_single
    assert cp_bench.shards_for(args, 4, 1000) == Shards.pages(4, 16)
    assert cp_bench.shards_for(cp_bench.parse_args(["--layout", "contiguous"]), 3, 1000) == Shards.contiguous(3, 334)
    assert cp_bench.shards_for(cp_bench.parse_args([]), 8, 1000) == Shards.interleaved(8)


@pytest.mark.parametrize("argv", [["--lengths", "0"], ["--lengths", "1x"], ["--lengths", ""], ["--heads", "8/3"],
                                  ["--heads", "32"], ["--layout", "pages0"], ["--layout", "rings"],
                                  ["--layers", "0"], ["--dtype", "fp8"], ["--repeats", "-1"], ["--backend", "mpi"]])
def test_cp_bench_refuses_bad_arguments(cp_bench, argv, capsys):
    with pytest.raises(SystemExit):
        cp_bench.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_cp_bench_rows(cp_bench):
    row = cp_bench.row_text(dict(world=8, layout="pages16", step_us=12.345, single_us=None))
    assert row.startswith("| 8 | pages16 | n/a") and "| 12.3 |" in row and row.endswith("| n/a |")
    assert cp_bench.row_text(dict(world=2, step_us=None, note="does not fit")).endswith("| does not fit")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cp_bench_says_it_needs_gpus(cp_bench, capsys):
    assert cp_bench.main(["--lengths", "1k"]) == 1
    assert "needs CUDA GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("call", ["decode", "decode_shards", "local_state"])
def test_a_layout_that_is_not_shards_is_refused(call):
    q = torch.zeros(1, 1, 2, 8)
    args = (q, [q], [q]) if call == "decode_shards" else (q, q, q)
    with pytest.raises(TypeError, match="^shards"):
        getattr(fdist, call)(*args, shards=(2, 1), **({"rank": 0} if call == "local_state" else {}))


def test_append_skips_negative_positions_and_clamps_cache_rows():
    shards = Shards.interleaved(1)
    cache = torch.zeros(2, 4, 1, 4)
    k = torch.ones(2, 1, 1, 4)
    fdist.append(cache, cache.clone(), k, k, shards=shards, rank=0, cache_seqlens=torch.tensor([-1, 1]),
                 cache_batch_idx=torch.tensor([0, 7], dtype=torch.int32))
    assert cache[0].eq(0).all() and cache[1, 1].eq(1).all() and cache.sum() == 4
