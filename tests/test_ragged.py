"""Ragged query lengths (FlashAttention 3's cu_seqlens_q, max_seqlen_q): q (total_q, nheads_q,
headdim) with each sequence's rows causal and bottom-right aligned to its own count. The GPU tests
compare each sequence's rows with the fp32 reference of that sequence alone (serving_ref), over
random counts 0-16 and every serving argument, check the LSE's (nheads_q, total_q) layout and
that equal counts give the 4-D call's bits; the CPU tests check the refusals, by name, through
the stand-in binding (fakes.py) and the real binding on the stand-in drivers."""

import pytest
import torch

import flash_decode
from conftest import FAKEDEVICE, assert_names, bound_errors, cpu_kernels, has_extension
from fakes import layout_binding  # noqa: F401  (a fixture)
from serving_ref import make_paged, reference_kvcache, rotary_tables
from test_native import launch_on_fake_device

cuda = pytest.mark.cuda


def counts_of(batch, max_q, generator):
    """Random rows per sequence in [0, max_q], one of them 0 and one max_q (batch >= 2)."""
    counts = torch.randint(0, max_q + 1, (batch,), generator=generator)
    counts[0], counts[-1] = 0, max_q
    return [int(n) for n in counts]


def offsets(counts, device):
    """cu_seqlens_q of these counts: int32 (batch + 1,)."""
    cu = [0]
    for n in counts:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def reference_ragged(q, counts, k_cache, v_cache, k=None, v=None, *, sinks=None, k_descale=None, v_descale=None,
                     **kwargs):
    """Each sequence alone (batch 1, its own rows) through reference_kvcache: out (total_q, nheads_q,
    headdim) and lse (nheads_q, total_q) in fp32, and the appended rows of the caches after the call
    as {(sequence, position): (k row, v row)}. An fp8 cache is taken at its descaled fp32 values;
    sinks join each row's softmax as in core/sinks.go."""
    if k_descale is not None:  # x attends as x * descale (per (batch, nheads_kv), or one value)
        kd, vd = (torch.as_tensor(d, dtype=torch.float32, device=q.device) for d in (k_descale, v_descale))
        k_cache, v_cache = k_cache.float(), v_cache.float()
    total, heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((heads, total), float("-inf"), device=q.device)
    appended, start = {}, 0
    lens, table, batch_idx = kwargs.pop("cache_seqlens"), kwargs.pop("block_table", None), kwargs.pop(
        "cache_batch_idx", None)
    leftpad, slopes = kwargs.pop("cache_leftpad", None), kwargs.pop("alibi_slopes", None)
    for b, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        kc, vc = k_cache, v_cache
        if table is None and batch_idx is None:
            kc, vc = k_cache[b:b + 1], v_cache[b:b + 1]
        if k_descale is not None:
            scale = (lambda d: d.view(-1)[0] if d.numel() == 1 else d[b].view(1, 1, -1, 1))
            kc, vc = kc * scale(kd), vc * scale(vd)
        one = dict(kwargs, cache_seqlens=lens[b:b + 1],
                   block_table=None if table is None else table[b:b + 1],
                   cache_batch_idx=None if batch_idx is None else batch_idx[b:b + 1],
                   cache_leftpad=None if leftpad is None else leftpad[b:b + 1],
                   alibi_slopes=None if slopes is None else slopes if slopes.dim() == 1 else slopes[b:b + 1])
        o, l_, k_after, v_after = reference_kvcache(q[None, rows], kc, vc, None if k is None else k[None, rows],
                                                    None if v is None else v[None, rows], **one)
        if sinks is not None:  # one more term exp(sink) in each row's denominator, with no value
            merged = torch.logaddexp(l_[0], sinks.float()[:, None].expand_as(l_[0]))
            o = o * torch.exp(l_[0] - merged).transpose(0, 1)[None, :, :, None]
            l_ = merged[None]
        out[rows], lse[:, rows] = o[0], l_[0]
        if k is not None:
            length = int(lens[b])
            for t in range(n):
                if table is not None:
                    page, slot = int(table[b, (length + t) // k_cache.shape[1]]), (length + t) % k_cache.shape[1]
                    appended[(b, t)] = (k_after[page, slot], v_after[page, slot])
                else:
                    appended[(b, t)] = (k_after[0 if batch_idx is None else int(batch_idx[b]), length + t],
                                        v_after[0 if batch_idx is None else int(batch_idx[b]), length + t])
        start += n
    return out, lse, appended


# name -> (dtype, options): the serving arguments each case passes (see ragged_call).
CASES = {
    "plain": (torch.float16, dict()),
    "bf16 split": (torch.bfloat16, dict(num_splits=3)),
    "paged": (torch.float16, dict(page_size=16)),
    "paged append rotary": (torch.float16, dict(page_size=16, append=True, rotary=True)),
    "paged append fused": (torch.bfloat16, dict(page_size=16, append=True)),
    "append contiguous": (torch.float16, dict(append=True)),
    "append rotary not interleaved, window": (torch.bfloat16, dict(append=True, rotary=True, interleaved=False,
                                                                   window=(9, 0))),
    "window softcap alibi": (torch.float16, dict(window=(20, 0), softcap=30.0, alibi=True)),
    "leftpad batch_idx": (torch.float16, dict(leftpad=True, batch_idx=True)),
    "sinks": (torch.bfloat16, dict(sinks=True)),
    "sinks split": (torch.float16, dict(sinks=True, num_splits=4)),
    "fp8 e4m3": (torch.float16, dict(fp8=torch.float8_e4m3fn)),
    "fp8 e5m2 paged": (torch.bfloat16, dict(fp8=torch.float8_e5m2, page_size=16)),
    "not causal": (torch.float16, dict(causal=False)),
    "mha long": (torch.float16, dict(heads=(8, 8), capacity=4096)),
}


def ragged_call(dtype, opts, seed, batch=6, max_q=5):
    """flash_decode's keyword arguments for a ragged call with opts (CASES), on the GPU, and the
    counts and reference arguments."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv = opts.get("heads", (8, 2))
    d, capacity, dev = 64, opts.get("capacity", 256), "cuda"
    counts = counts_of(batch, max_q, g)
    total = sum(counts)
    append = opts.get("append", False)
    lens = torch.randint(1, capacity - max_q, (batch,), generator=g, dtype=torch.int32)
    lens[1] = 0  # an empty cache row
    q = torch.randn(total, hq, d, generator=g).to(dtype).to(dev)
    kd = torch.randn(batch, capacity, hkv, d, generator=g).to(dtype)
    vd = torch.randn(batch, capacity, hkv, d, generator=g).to(dtype)
    kw = dict(causal=opts.get("causal", True), cache_seqlens=lens.to(dev), num_splits=opts.get("num_splits", 0))
    ref = {}
    k_cache, v_cache = kd.to(dev), vd.to(dev)
    if opts.get("page_size"):
        k_cache, v_cache, table = make_paged(k_cache, v_cache, opts["page_size"], generator=g)
        kw["block_table"] = table.to(dev)
    if opts.get("fp8"):  # converted whole (torch before 2.10 cannot index fp8 tensors)
        kw["k_descale"] = (torch.rand(batch, hkv, generator=g) + 0.5).to(dev)
        kw["v_descale"] = (torch.rand(batch, hkv, generator=g) + 0.5).to(dev)
        k_cache, v_cache = k_cache.to(opts["fp8"]), v_cache.to(opts["fp8"])
    if opts.get("batch_idx"):
        rows = torch.randperm(batch + 2, generator=g)[:batch].to(torch.int32)
        k_cache = torch.randn(batch + 2, capacity, hkv, d, generator=g).to(dtype).to(dev)
        v_cache = torch.randn(batch + 2, capacity, hkv, d, generator=g).to(dtype).to(dev)
        kw["cache_batch_idx"] = rows.to(dev)
    if opts.get("leftpad"):
        kw["cache_leftpad"] = torch.minimum(lens, torch.randint(0, 40, (batch,), generator=g,
                                                                dtype=torch.int32)).to(dev)
    if append:
        ref["k"] = torch.randn(total, hkv, d, generator=g).to(dtype).to(dev)
        ref["v"] = torch.randn(total, hkv, d, generator=g).to(dtype).to(dev)
    if opts.get("rotary"):
        kw["rotary_cos"], kw["rotary_sin"] = (t.to(dtype).to(dev) for t in rotary_tables(capacity, 32))
        kw["rotary_interleaved"] = opts.get("interleaved", True)
    if opts.get("window"):
        kw["window_size"] = opts["window"]
    if opts.get("softcap"):
        kw["softcap"] = opts["softcap"]
    if opts.get("alibi"):
        kw["alibi_slopes"] = (torch.rand(batch, hq, generator=g) * 0.3).to(dev)
    if opts.get("sinks"):
        ref["sinks"] = torch.randn(hq, generator=g).to(dev)
    return q, k_cache, v_cache, counts, kw, ref


@cuda
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("max_q, planned", [(5, 6), (16, 16)], ids=["5 of 6 planned", "16"])
def test_ragged_matches_each_sequence_alone(case, max_q, planned):
    dtype, opts = CASES[case]
    q, k_cache, v_cache, counts, kw, ref = ragged_call(dtype, opts, seed=max_q, max_q=max_q)
    cu = offsets(counts, q.device)
    k, v, sinks = ref.get("k"), ref.get("v"), ref.get("sinks")
    ref_kw = {name: value for name, value in kw.items() if name not in ("num_splits",)}
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = flash_decode.flash_decode(q, k_cache, v_cache, k, v, cu_seqlens_q=cu, max_seqlen_q=planned,
                                         sinks=sinks, return_softmax_lse=True, **kw)
    ref_out, ref_lse, appended = reference_ragged(q, counts, k_before, v_before, k, v, sinks=sinks, **ref_kw)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    errors = bound_errors(out, lse.transpose(0, 1), ref_out, ref_lse.transpose(0, 1), q.dtype)
    assert not errors, errors
    for (b, t), (k_row, v_row) in appended.items():  # each sequence appended its own rows
        length, table = int(kw["cache_seqlens"][b]), kw.get("block_table")
        if table is not None:
            page, slot = int(table[b, (length + t) // k_cache.shape[1]]), (length + t) % k_cache.shape[1]
        else:
            page = b if kw.get("cache_batch_idx") is None else int(kw["cache_batch_idx"][b])
            slot = length + t
        # Rotary rounds in fp32 then to q's dtype, as the reference may differ by its last bit.
        torch.testing.assert_close(k_cache[page, slot].float(), k_row.float().to(k_cache.device), rtol=1e-2, atol=1e-2)
        assert torch.equal(v_cache[page, slot], v_row.to(v_cache.device)), (b, t)


@cuda
@pytest.mark.parametrize("max_q", [1, 4, 16])
def test_counts_up_to_16_and_splits(max_q):
    """Long caches (the combine, the cluster merge) and every count 0..max_q."""
    g = torch.Generator().manual_seed(max_q)
    batch, hq, hkv, d, capacity = 17, 32, 8, 128, 8192
    counts = [i % (max_q + 1) for i in range(batch)]
    q = torch.randn(sum(counts), hq, d, generator=g).half().cuda()
    k_cache, v_cache = (torch.randn(batch, capacity, hkv, d, generator=g).half().cuda() for _ in "kv")
    lens = torch.randint(0, capacity, (batch,), generator=g, dtype=torch.int32).cuda()
    ref_out, ref_lse, _ = reference_ragged(q, counts, k_cache, v_cache, cache_seqlens=lens, causal=True)
    for num_splits in (0, 1, 40):
        out, lse = flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                             num_splits=num_splits, return_softmax_lse=True,
                                             cu_seqlens_q=offsets(counts, "cuda"), max_seqlen_q=max_q)
        errors = bound_errors(out, lse.transpose(0, 1), ref_out, ref_lse.transpose(0, 1), q.dtype)
        assert not errors, f"num_splits {num_splits}: {errors}"


@cuda
@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_equal_counts_give_the_4d_calls_bits(append, num_splits):
    g = torch.Generator().manual_seed(7)
    batch, sq, hq, hkv, d, capacity = 5, 3, 16, 4, 128, 2048
    q4 = torch.randn(batch, sq, hq, d, generator=g).half().cuda()
    caches = [torch.randn(batch, capacity, hkv, d, generator=g).half().cuda() for _ in "kv"]
    lens = torch.randint(0, capacity - sq, (batch,), generator=g, dtype=torch.int32).cuda()
    new = [torch.randn(batch, sq, hkv, d, generator=g).half().cuda() for _ in "kv"] if append else [None, None]
    k4, v4 = (c.clone() for c in caches)
    out4, lse4 = flash_decode.flash_decode(q4, k4, v4, *new, cache_seqlens=lens, causal=True,
                                           num_splits=num_splits, return_softmax_lse=True)
    kr, vr = (c.clone() for c in caches)
    flat = [None if t is None else t.reshape(batch * sq, hkv, d) for t in new]
    cu = torch.arange(0, batch * sq + 1, sq, dtype=torch.int32, device="cuda")
    out, lse = flash_decode.flash_decode(q4.reshape(batch * sq, hq, d), kr, vr, *flat, cache_seqlens=lens,
                                         causal=True, num_splits=num_splits, return_softmax_lse=True,
                                         cu_seqlens_q=cu, max_seqlen_q=sq)
    assert torch.equal(out, out4.reshape(batch * sq, hq, d))
    assert torch.equal(lse, lse4.permute(1, 0, 2).reshape(hq, batch * sq))
    assert torch.equal(kr, k4) and torch.equal(vr, v4)


@cuda
def test_padding_rows_and_other_rows_are_never_written():
    """Rows of q no sequence has (past cu_seqlens_q[-1]) keep out's and lse's contents; offsets
    past total_q are clamped, not followed."""
    q = torch.randn(9, 8, 64, dtype=torch.float16, device="cuda")
    k, v = (torch.randn(3, 128, 2, 64, dtype=torch.float16, device="cuda") for _ in "kv")
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, 7.0)
    _, lse = flash_decode.flash_decode(q, k, v, cu_seqlens_q=cu, max_seqlen_q=4, out=out, causal=True,
                                       return_softmax_lse=True)
    assert (out[5:] == 7).all() and (out[:5] != 7).any()
    wild = torch.tensor([0, 3, 100, -5], dtype=torch.int32, device="cuda")  # clamped: memory-safe
    flash_decode.flash_decode(q, k, v, cu_seqlens_q=wild, max_seqlen_q=4, causal=True)
    torch.cuda.synchronize()
    assert lse.shape == (8, 9)


@cuda
def test_decoder_takes_cu_seqlens_q_per_call():
    g = torch.Generator().manual_seed(3)
    batch, hq, hkv, d = 4, 8, 2, 64
    k_cache, v_cache, table = make_paged(*(torch.randn(batch, 256, hkv, d, generator=g).half().cuda()
                                           for _ in "kv"), 16, generator=g)
    table = table.cuda()
    lens = torch.tensor([10, 0, 200, 77], dtype=torch.int32, device="cuda")
    q = torch.randn(12, hq, d, generator=g).half().cuda()
    cu = offsets([3, 0, 4, 5], "cuda")
    dec = flash_decode.Decoder(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, causal=True,
                               cu_seqlens_q=cu, max_seqlen_q=5, return_softmax_lse=True, max_seqlen_k=256)
    for counts in ([3, 0, 4, 5], [1, 1, 1, 1], [0, 5, 2, 5]):
        cu.copy_(offsets(counts, "cuda"))
        out, lse = dec(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, cu_seqlens_q=cu)
        want, want_lse = flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                                   causal=True, cu_seqlens_q=cu, max_seqlen_q=5,
                                                   return_softmax_lse=True, max_seqlen_k=256)
        rows = sum(counts)
        assert torch.equal(out[:rows], want[:rows]) and torch.equal(lse[:, :rows], want_lse[:, :rows])


# ---- CPU: what Python refuses, by name, through the stand-in binding ----

def cpu_args(total=5, batch=3, max_q=4):
    q = torch.zeros(total, 8, 64, dtype=torch.float16)
    k = torch.zeros(batch, 128, 2, 64, dtype=torch.float16)
    return dict(q=q, k_cache=k, v_cache=torch.zeros_like(k),
                cache_seqlens=torch.zeros(batch, dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 2, 2, 5], dtype=torch.int32), max_seqlen_q=max_q, causal=True)


REFUSALS = [
    ("cu not a tensor", dict(cu_seqlens_q=[0, 2, 2, 5]), TypeError, "cu_seqlens_q"),
    ("cu int64", dict(cu_seqlens_q=torch.tensor([0, 2, 2, 5])), TypeError, "cu_seqlens_q"),
    ("cu 2-D", dict(cu_seqlens_q=torch.zeros(1, 4, dtype=torch.int32)), ValueError, "cu_seqlens_q"),
    ("cu of one element", dict(cu_seqlens_q=torch.zeros(1, dtype=torch.int32)), ValueError, "cu_seqlens_q"),
    ("cu strided", dict(cu_seqlens_q=torch.zeros(8, dtype=torch.int32)[::2]), ValueError, "cu_seqlens_q"),
    ("cu longer than the batch", dict(cu_seqlens_q=torch.zeros(5, dtype=torch.int32)), ValueError, "cu_seqlens_q"),
    ("cu shorter than the batch", dict(cu_seqlens_q=torch.zeros(3, dtype=torch.int32)), ValueError, "cu_seqlens_q"),
    ("no max_seqlen_q", dict(max_seqlen_q=None), ValueError, "max_seqlen_q"),
    ("max_seqlen_q float", dict(max_seqlen_q=4.0), TypeError, "max_seqlen_q"),
    ("max_seqlen_q without cu", dict(cu_seqlens_q=None), ValueError, "max_seqlen_q"),
    ("q 4-D", dict(q=torch.zeros(1, 5, 8, 64, dtype=torch.float16)), ValueError, "q"),
    ("out 4-D", dict(out=torch.zeros(1, 5, 8, 64, dtype=torch.float16)), ValueError, "out"),
    ("out of another shape", dict(out=torch.zeros(6, 8, 64, dtype=torch.float16)), ValueError, "out"),
    ("k 4-D", dict(k=torch.zeros(1, 5, 2, 64, dtype=torch.float16), v=torch.zeros(1, 5, 2, 64,
                                                                               dtype=torch.float16)),
     ValueError, "k"),
    ("k of other rows", dict(k=torch.zeros(4, 2, 64, dtype=torch.float16), v=torch.zeros(4, 2, 64,
                                                                                    dtype=torch.float16)),
     ValueError, "k"),
]


@pytest.mark.parametrize("case, change, exc, name", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_python_refuses_by_name(layout_binding, case, change, exc, name):
    args = cpu_args()
    args.update(change)
    q, k_cache, v_cache = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    with pytest.raises(exc) as info:
        flash_decode.flash_decode(q, k_cache, v_cache, **args)
    assert_names(info.value, exc, name)
    assert layout_binding.args("Run") == []  # a refused call writes nothing


def test_layout_and_pointers_through_the_stand_in(layout_binding):
    args = cpu_args()
    q, k_cache, v_cache = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    out, lse = flash_decode.flash_decode(q, k_cache, v_cache, return_softmax_lse=True, **args)
    ((layout, _),) = layout_binding.args("Prepare")
    assert layout["ragged"] == 1 and layout["total_q"] == 5 and layout["batch"] == 3 and layout["seqlen_q"] == 4
    assert layout["q"] == (0, 8 * 64, 64, 1) and layout["out"] == (0, 8 * 64, 64, 1)
    assert out.shape == q.shape and lse.shape == (8, 5)
    ((_, _, *pointers, _, _, _),) = layout_binding.args("Run")
    assert pointers[-1] == args["cu_seqlens_q"].data_ptr()
    # Appending: k and v flattened as q, seqlen_new the planned count.
    k = torch.zeros(5, 2, 64, dtype=torch.float16)
    flash_decode.flash_decode(q, k_cache, v_cache, k, torch.zeros_like(k), **args)
    layout = layout_binding.args("Prepare")[-1][0]
    assert layout["seqlen_new"] == 4 and layout["k_new"] == (0, 2 * 64, 64, 1)


@pytest.mark.skipif(not has_extension(), reason="needs the built extension")
def test_plan_of_ragged_lengths_is_the_uniform_one():
    cu = torch.zeros(5, dtype=torch.int32)
    ragged = flash_decode.plan(4, 3, 32, 8, 128, 8192, device=-1, lengths=True, cu_seqlens_q=cu)
    uniform = flash_decode.plan(4, 3, 32, 8, 128, 8192, device=-1, lengths=True)
    assert ragged == uniform
    with pytest.raises(NotImplementedError) as info:
        flash_decode.plan(4, 17, 32, 8, 128, 8192, device=-1, cu_seqlens_q=cu)
    assert_names(info.value, NotImplementedError, "max_seqlen_q")
    with pytest.raises(ValueError) as info:
        flash_decode.plan(3, 3, 32, 8, 128, 8192, device=-1, cu_seqlens_q=cu)
    assert_names(info.value, ValueError, "cu_seqlens_q")


_RAGGED_ON_THE_FAKE_DEVICE = """
import json
import torch
import flash_decode
from flash_decode import _native
from records import prepare
b, G = _native.binding(), 1 << 30
rows = (0, 8 * 64, 64, 1)
layout = dict(dtype=1, batch=3, seqlen_q=4, heads_q=8, heads_kv=2, head_dim=64, seqlen_cache=128, q=rows,
              k_cache=(128 * 128, 128, 64, 1), v_cache=(128 * 128, 128, 64, 1), out=rows, window_left=-1,
              window_right=-1, ragged=1, total_q=5, device_lengths=1)
h = prepare(b, layout, 0)
ws = b.Workspace(h, -1)
errors = {}
for name, ptrs in dict(missing=(4 * G, 0), misaligned=(4 * G, 11 * G + 2), fine=(4 * G, 11 * G)).items():
    status = b.Run(h, -1, 1 * G, 64 * G, 128 * G, 2 * G, 3 * G, ptrs[0], 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, ptrs[1],
                   10 * G, ws, 0)
    errors[name] = b.ErrorMessage(status) if status < 0 else status
for name, change in dict(max_seqlen_q=dict(seqlen_q=17), total_q=dict(total_q=0)).items():
    try:
        prepare(b, dict(layout, **change), 0)
    except (ValueError, NotImplementedError) as err:
        errors[name] = str(err)
print(json.dumps(errors))
"""


@pytest.mark.skipif(not has_extension() or not (FAKEDEVICE / "libcuda.so.1").exists(),
                    reason="needs the built extension and the fake-device driver")
def test_the_core_refuses_by_name_on_the_fake_device(tmp_path):
    errors, launches = launch_on_fake_device(_RAGGED_ON_THE_FAKE_DEVICE, tmp_path)
    assert ": cu_seqlens_q: " in errors["missing"] and "null device pointer" in errors["missing"]
    assert ": cu_seqlens_q: " in errors["misaligned"] and "aligned" in errors["misaligned"]
    assert errors["fine"] >= 1 and launches  # launched
    assert ": max_seqlen_q: " in errors["max_seqlen_q"] and ": total_q: " in errors["total_q"]


# ---- torch.compile: the ops carry cu_seqlens_q and max_seqlen_q ----

_COMPILED = []


def _recording_decode(q, *args, **kwargs):
    """A CPU kernel for flash_decode::decode that records its last two arguments."""
    _COMPILED.append((kwargs["cu_seqlens_q"], kwargs["max_seqlen_q"]) if "cu_seqlens_q" in kwargs else args[-2:])
    return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])


def test_compiled_ragged_call_passes_its_offsets():
    with cpu_kernels({"decode": _recording_decode}):
        args = cpu_args()
        q, k_cache, v_cache, lens, cu = (args[n] for n in ("q", "k_cache", "v_cache", "cache_seqlens",
                                                           "cu_seqlens_q"))

        def step(q, k_cache, v_cache, lens, cu):
            out, lse = flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=cu,
                                                 max_seqlen_q=4, causal=True, return_softmax_lse=True)
            return out * 1, lse

        out, lse = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_cache, v_cache, lens, cu)
        assert out.shape == q.shape and lse.shape == (8, 5)
        got_cu, got_max = _COMPILED[-1]
        assert torch.equal(got_cu, cu) and got_max == 4
        with pytest.raises(Exception, match="max_seqlen_q: invalid argument: must be given with cu_seqlens_q") as raised:
            torch.compile(lambda q: flash_decode.flash_decode(q, k_cache, v_cache, cu_seqlens_q=cu),
                          fullgraph=True, backend="aot_eager")(q)  # checked at trace time, as eagerly
        # fullgraph wraps the error in dynamo's own, which shows it as raised.
        assert isinstance(raised.value, ValueError) or "ValueError(" in str(raised.value), raised.value


def test_decoder_of_a_ragged_layout(layout_binding):
    args = cpu_args()
    q, k_cache, v_cache, lens, cu = (args[n] for n in ("q", "k_cache", "v_cache", "cache_seqlens", "cu_seqlens_q"))
    dec = flash_decode.Decoder(q, k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=cu, max_seqlen_q=4,
                               return_softmax_lse=True)
    ((layout, _),) = layout_binding.args("Prepare")
    assert layout["ragged"] == 1 and layout["total_q"] == 5 and layout["seqlen_q"] == 4
    cu2 = cu.clone()
    out, lse = dec(q, k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=cu2)
    assert out.shape == q.shape and lse.shape == (8, 5)
    ((_, _, *pointers, _, _, _),) = layout_binding.args("Run")
    assert pointers[-1] == cu2.data_ptr()
    with pytest.raises(ValueError) as info:  # a cu_seqlens_q of another batch: not the layout's
        dec(q, k_cache, v_cache, cache_seqlens=lens, cu_seqlens_q=torch.zeros(5, dtype=torch.int32))
    assert_names(info.value, ValueError, "cu_seqlens_q")
    assert len(layout_binding.args("Run")) == 1
