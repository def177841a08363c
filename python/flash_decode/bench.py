"""Decode-attention benchmark: flash_decode against its peers, side by side.

    python -m flash_decode.bench                  # default matrix, about 3-4 min on an H200
    python -m flash_decode.bench --quick --out /tmp/fdbench
    python -m flash_decode.bench --shapes "b=1,hq=32,hkv=8,d=128,L=32768,sq=1" --dtypes fp16,bf16
    python -m flash_decode.bench --shapes "b=1/8,L=1k/32k;hq=48,hkv=48,L=8k,sq=10" --peers cudnn,flash
    python -m flash_decode.bench --shapes "b=1,L=1k/32k" --num-splits 1,2,4,8,16,32 --peers none
    python -m flash_decode.bench --read-same-bytes --peers cudnn   # a plain read of each cache too
    python -m flash_decode.bench --shapes none --lengths "32768,1024*7;hq=8,hkv=1:16k,4k*3"  # ragged batches
    python -m flash_decode.bench --kv-dtype fp8_e4m3 --read-same-bytes --paged16 --sinks --peers flashinfer
    python -m flash_decode.bench --serving-matrix   # ragged lengths on shuffled pages, FlashInfer on the same
    python -m flash_decode.bench --batch-invariant --peers none   # batch_invariant=True beside each call
    python -m flash_decode.bench --ragged   # ragged query lengths (cu_seqlens_q) against uniform and padded calls
    flash-decode-bench --help                     # the same, as a console script

Peers run in the same process on the same tensors: torch SDPA with the cuDNN,
flash and efficient backends, FlexAttention under torch.compile, and FlashInfer
where `import flashinfer` works (it is never a dependency; without it the peer is
not offered). Every SDPA and Flex call is non-causal (seqlen_q > 1 too) over the
whole cache (cache_seqlens=None), so no peer needs a mask. GQA peers get
enable_gqa=True; a backend that refuses it gets K/V expanded by repeat_interleave
outside the timed region (noted "expanded"). A peer that cannot run a shape
shows as "n/a (reason)".
FlashInfer runs on NHD paged views of the same caches (a free reshape where a
layer is contiguous, as with --layout bshd; a contiguous copy per layer made
outside the timed region otherwise): its decode wrapper for seqlen_q 1 and its
prefill wrapper for seqlen_q > 1, where its rows are causal (the last query row
sees the whole cache) and are checked against a causal fp32 reference. Page size
16 and one page per sequence, tensor cores on and off (decode), each timed alike;
the fastest is reported, named in the note (e.g. "page16, tensor cores, graph").

Each call reads a different KV cache ("layer") in rotation, max(3, 240 MB /
cache) of them within 40% of free memory, so the 60 MB L2 never holds the one
being read. Kernel time: a CUDA graph of one call per layer, replayed --repeats
times between CUDA events (median per call); each case starts after a pause
that lets the driver finish with the previous case's freed memory (--settle).
Eager time: plain calls in a loop, synchronized at the end (host overhead
included). TB/s counts K and V bytes only (q and out are under 1% on every
default shape); the ceiling is the best streaming read (torch.sum, Triton)
over rotating 1 GiB buffers, measured first.
fp8 caches (--kv-dtype) come with a (batch, nheads_kv) descale; each row times the same
shape with caches in q's dtype too. The serving matrix (--serving-matrix) draws ragged
lengths (seeded) and deals shuffled pools of pages, the same pools for flash_decode and
FlashInfer (planned with the same lengths), beside a contiguous cache of those lengths.
--batch-invariant times each table case again with batch_invariant=True. --ragged draws a
batch's query lengths (seeded) and times one call with cu_seqlens_q, the uniform 4-D calls of
each length (summed) and one call padded to the longest, on the same caches.
Outputs: results.json, results.csv and bandwidth.png under --out, and each table as
markdown (table.md, serving.md, ragged.md), printed too.
"""

import argparse
import csv
import functools
import itertools
import json
import logging
import math
import re
import statistics
import sys
import time
import warnings
from collections import namedtuple
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_decode

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch.sum read alone sets the ceiling
    triton = None

Shape = namedtuple("Shape", "b hq hkv d L sq")
SHAPE_DEFAULTS = Shape(b=1, hq=32, hkv=8, d=128, L=32768, sq=1)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # fp8 caches (--kv-dtype)
DESCALE_RANGE = (0.5, 1.5)  # flash_decode's (batch, nheads_kv) fp8 descales, seeded, uniform in it
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}
BASE_PEERS = ("cudnn", "flash", "efficient", "flex")
MB = 1e6                    # decimal MB
L2_ROTATION_BYTES = 240e6   # 4x the H200's 60 MB L2
MEMORY_FRACTION = 0.4       # of free GPU memory, for the rotated caches
MIN_CALLS = 20              # calls per graph replay, at least
SETTLE_S = 0.5              # pause after each case frees its memory (see settle)
TOL = {torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}  # atol, rtol vs fp32 SDPA
TINY = Shape(b=1, hq=32, hkv=8, d=128, L=256, sq=1)  # the eager call's shape (host overhead)

# The default matrix: a cross-section, not the full product (~30 cases, 3-4 min).
# Each spec expands "/" alternatives; unnamed fields take SHAPE_DEFAULTS.
DEFAULT_MATRIX = [
    ("fp16", "b=1,L=1k/4k/32k/128k"),             # 32/8 d128: cache length and batch sweep
    ("fp16", "b=8,L=1k/8k/64k"),
    ("fp16", "b=32,L=1k/16k"),
    ("fp16", "b=128,L=1k/8k"),
    ("fp16", "b=256,L=2k"),
    ("fp16", "b=1,hq=32,hkv=32,L=32k;b=16,hq=32,hkv=32,L=4k"),   # MHA
    ("fp16", "b=1,hq=64,hkv=8,L=32k;b=8,hq=64,hkv=8,L=8k"),      # GQA 8
    ("fp16", "b=1,hq=48,hkv=48,L=8k,sq=1/10;b=8,hq=48,hkv=48,L=4k,sq=10"),
    ("fp16", "b=3,hq=48,hkv=48,L=4k;b=4,hq=48,hkv=48,L=2k"),     # more blocks than SMs
    ("fp16", "b=1,hq=8,hkv=1,L=128k;b=32,hq=8,hkv=1,L=16k"),     # MQA
    ("fp16", "b=8,d=64,L=32k;b=1,d=256,L=32k;b=16,d=256,L=2k"),
    ("fp16", "b=1,L=32k,sq=4;b=16,L=8k,sq=4"),
    ("bf16", "b=1,L=1k/32k;b=64,L=4k;b=1,hq=48,hkv=48,L=8k,sq=10"),
]
# Serving cases: the same shapes (32/8 heads, d128 unless given, causal, cache_seqlens
# a tensor) on a contiguous cache, on paged caches (a random block order) and with this
# step's tokens appended; each is timed against the contiguous one of its shape. "ragged"
# holds L keys in sequence 0 and L/16 in each other one (TB/s counts the keys held).
SERVING_SHAPES = "b=1,L=32k;b=8,L=4k/32k;b=32,L=8k"
SERVING_QUICK = "b=8,L=32k"
SERVING_CASES = {  # name: (page size, append, rotary, capacity over L, max_seqlen_k=L, ragged)
    "contiguous": (0, False, False, 1, False, False),
    "paged16": (16, False, False, 1, False, False),
    "paged1": (1, False, False, 1, False, False),
    "append": (0, True, False, 1, False, False),                   # stage 1 appends itself (no append kernel)
    "append+rotary": (0, True, True, 1, False, False),             # the append kernel first, rotating q and k
    "paged16+append": (16, True, False, 1, False, False),
    "paged16+append+rotary": (16, True, True, 1, False, False),
    "8x capacity": (0, False, False, 8, False, False),             # a cache allocated for 8L keys holding L
    "8x capacity+max_seqlen_k": (0, False, False, 8, True, False),  # the same, planned for L
    "ragged": (0, False, False, 1, True, True),                    # one sequence of L keys, the others L/16
}
RAGGED_SHARE = 16  # the other sequences of the ragged case hold L / RAGGED_SHARE keys


def serving_lengths(b, L, ragged):
    """The ragged case's lengths: L for sequence 0, L / RAGGED_SHARE (at least 1) for the
    others; else L for every sequence."""
    if not ragged:
        return [L] * b
    return [L] + [max(1, L // RAGGED_SHARE)] * (b - 1)

FLASHINFER_PAGES = (16, None)          # None: one page per sequence (page size L)
FLASHINFER_WORKSPACE = 128 * 1024 * 1024  # bytes, FlashInfer's recommended workspace

QUICK_MATRIX = [
    ("fp16", "b=1,L=1k;b=8,L=32k;b=1,hq=48,hkv=48,L=8k,sq=10;b=16,hq=8,hkv=1,d=64,L=4k,sq=4"),
    ("bf16", "b=4,d=256,L=16k"),
]
# The fp8 table (--kv-dtype): decode shapes of the default matrix, 4 MB-1 GB of fp8 bytes.
FP8_MATRIX = [
    ("fp16", "b=1,L=4k/32k/128k"),
    ("fp16", "b=8,L=1k/8k/64k"),
    ("fp16", "b=32,L=1k/16k"),
    ("fp16", "b=128,L=1k"),
    ("fp16", "b=16,hq=32,hkv=32,L=4k;b=8,hq=64,hkv=8,L=8k;b=32,hq=8,hkv=1,L=16k"),
    ("fp16", "b=8,d=64,L=32k;b=16,d=256,L=2k"),
    ("bf16", "b=1,L=32k;b=64,L=4k"),
]
FP8_QUICK = [("fp16", "b=1,L=4k;b=8,L=8k;b=16,d=256,L=2k"), ("bf16", "b=1,L=32k")]  # FlashInfer modules: the full one's

# The serving matrix (--serving-matrix): (q dtype, cache dtype or None for q's, spec); L=LO-HI
# draws each sequence's length uniformly from [LO, HI] (seeded); 16 shapes, 3-4 min.
SERVING_MATRIX = [
    ("fp16", None, "b=8,L=2k-8k;b=32,L=512-4k;b=64,hq=64,hkv=8,L=1k-2k;b=1,L=32k"),
    ("fp16", None, "b=16,hq=8,hkv=1,L=4k-16k;b=4,hq=28,hkv=4,L=16k-64k;b=128,L=256-1k;b=256,L=128-2k"),
    ("bf16", None, "b=16,L=1k-8k"),
    ("fp16", None, "b=16,hq=32,hkv=32,d=64,L=1k-4k;b=8,hq=16,hkv=8,d=256,L=2k-8k;b=32,d=256,L=1k-4k"),
    ("fp16", None, "b=2,L=100-1536"),
    ("fp16", "fp8_e4m3", "b=8,L=2k-8k;b=32,L=512-4k;b=8,hq=16,hkv=8,d=256,L=2k-8k"),
]
SERVING_MATRIX_QUICK = [("fp16", None, "b=8,L=2k-8k;b=2,L=100-1536"), ("fp16", "fp8_e4m3", "b=32,L=512-4k")]
SERVING_PAGES = (16, 1)  # page sizes of the serving matrix's shuffled pools
# Ragged batches (--ragged): sq is the longest query length, each sequence's drawn from 1..sq
# (seeded); sq=LO-HI draws from LO..HI, so sq=4-4 is a uniform batch through the ragged call.
RAGGED_MATRIX = "b=8,L=4k,sq=8;b=32,L=8k,sq=4;b=32,L=8k,sq=16;b=64,L=2k,sq=8;b=8,L=32k,sq=4-4;b=32,L=8k,sq=16-16"
RAGGED_QUICK = "b=8,L=4k,sq=8;b=8,L=4k,sq=4-4"


# ---- peers (pure: tested on CPU) ----

@functools.cache
def import_flashinfer():
    """The flashinfer module, or None where `import flashinfer` fails."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import flashinfer
    except Exception:  # noqa: BLE001 (missing, or built for another torch or CUDA)
        return None
    return flashinfer


def available_peers():
    """The peers this machine offers: BASE_PEERS, and flashinfer where it imports."""
    return BASE_PEERS + (("flashinfer",) if import_flashinfer() is not None else ())


def paged_indices(b, L, page, device="cpu"):
    """FlashInfer's page table for b sequences of L keys stored in order, sequence i
    in pages [i * n, (i + 1) * n) of n = ceil(L / page): (paged_kv_indptr (b + 1,),
    paged_kv_indices (b * n,), paged_kv_last_page_len (b,)), all int32."""
    return ragged_paged_indices([L] * b, L, page, device)


def ragged_paged_indices(lengths, cap, page, device="cpu"):
    """paged_indices for sequences of the given lengths (at least 1 key each) in a
    cache of cap keys a sequence: sequence i in the first ceil(lengths[i] / page) of
    its own ceil(cap / page) pages."""
    n = -(-cap // page)
    pages = [-(-x // page) for x in lengths]
    indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=device)
    indices = torch.tensor([i * n + j for i, p in enumerate(pages) for j in range(p)], dtype=torch.int32,
                           device=device)
    last = torch.tensor([x - (p - 1) * page for x, p in zip(lengths, pages)], dtype=torch.int32, device=device)
    return indptr, indices, last


def shuffled_pages(lengths, page, generator=None):
    """A shuffled page pool for sequences of the given lengths (at least 1 key each):
    sequence i takes ceil(lengths[i] / page) pages, dealt from a random permutation of
    the pool's pages (generator: a seeded torch.Generator). Returns (block_table (b, most
    pages; unused entries 0), FlashInfer's (paged_kv_indptr, paged_kv_indices,
    paged_kv_last_page_len)) over the same pages, int32 on the CPU."""
    if min(lengths) < 1:
        raise ValueError(f"a sequence of the pool holds no keys: {min(lengths)}")
    pages = [-(-x // page) for x in lengths]
    indices = torch.randperm(sum(pages), generator=generator).to(torch.int32)
    indptr = [0, *itertools.accumulate(pages)]
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    for i, n in enumerate(pages):
        table[i, :n] = indices[indptr[i]:indptr[i + 1]]
    last = torch.tensor([x - (n - 1) * page for x, n in zip(lengths, pages)], dtype=torch.int32)
    return table, (torch.tensor(indptr, dtype=torch.int32), indices, last)


def paged_view(cache, page):
    """A (b, L, hkv, d) cache as (b * L / page, page, hkv, d) NHD pages in sequence
    order: a view of a contiguous cache, a contiguous copy otherwise."""
    b, L, hkv, d = cache.shape
    if L % page:
        raise ValueError(f"cache length {L} is not a multiple of page size {page}")
    return cache.contiguous().view(b * L // page, page, hkv, d)


PEERS = available_peers()


# ---- arguments and shapes (pure: tested on CPU) ----

def parse_int(text):
    """'32768', '32k' or '32K' -> 32768."""
    text = text.strip()
    scale = 1024 if text[-1:] in "kK" and text[:-1] else 1
    return int(text[:-1] if scale > 1 else text) * scale


def parse_shapes(text):
    """'b=1/8,hq=32,hkv=8,d=128,L=32k,sq=1;...' -> [Shape]: ';' separates specs,
    '/' lists alternatives (their product is taken), missing fields default."""
    keys = {f.lower(): f for f in Shape._fields}
    shapes = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        choices = {}
        for item in spec.split(","):
            key, sep, values = item.partition("=")
            if not sep or key.strip().lower() not in keys:
                raise ValueError(f"bad shape field {item!r} in {spec!r}: use b, hq, hkv, d, L, sq")
            choices[keys[key.strip().lower()]] = [parse_int(v) for v in values.split("/")]
        fields = [choices.get(f, [getattr(SHAPE_DEFAULTS, f)]) for f in Shape._fields]
        shapes += [Shape(*combo) for combo in itertools.product(*fields)]
    for s in shapes:
        if min(s) < 1 or s.hq % s.hkv:
            raise ValueError(f"bad shape {label(s)}: sizes must be positive, hq a multiple of hkv")
    return shapes


def label(shape):
    return ",".join(f"{k}={v}" for k, v in shape._asdict().items())


Batch = namedtuple("Batch", "hq hkv d lengths")  # a --lengths batch: heads, head dim, each sequence's keys


def parse_lengths(text):
    """'32768,1024*7;hq=8,hkv=1:8k*4' -> [Batch]: ';' separates batches, ',' their
    sequences' lengths, LEN*N repeats LEN N times (k suffixes work); an optional
    'hq=..,hkv=..,d=..:' prefix sets the heads and head dim (default 32/8, d128)."""
    batches = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        heads, colon, rest = spec.rpartition(":")
        sizes = dict(hq=SHAPE_DEFAULTS.hq, hkv=SHAPE_DEFAULTS.hkv, d=SHAPE_DEFAULTS.d)
        for item in filter(None, heads.split(",")) if colon else ():
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in sizes:
                raise ValueError(f"bad field {item!r} in {spec!r}: use hq, hkv, d before the ':'")
            sizes[key.strip()] = parse_int(value)
        if min(sizes.values()) < 1 or sizes["hq"] % sizes["hkv"]:
            raise ValueError(f"bad heads in {spec!r}: sizes must be positive, hq a multiple of hkv")
        lengths = []
        for item in rest.split(","):
            value, star, count = item.partition("*")
            try:
                length, times = parse_int(value), parse_int(count) if star else 1
            except ValueError:
                raise ValueError(f"bad length {item.strip()!r} in {spec!r}: use LEN or LEN*N") from None
            if length < 0 or times < 1:
                raise ValueError(f"bad length {item.strip()!r} in {spec!r}: lengths 0 or more, N at least 1")
            lengths += [length] * times
        if max(lengths) < 1:
            raise ValueError(f"batch {spec!r} holds no keys")
        batches.append(Batch(lengths=tuple(lengths), **sizes))
    return batches


Serving = namedtuple("Serving", "shape lo")  # a serving-matrix shape: lengths lo..shape.L


def ranged_specs(text, field):
    """'b=8,L=2k-8k;b=1' -> [(spec, Shape, LO or None)]: parse_shapes' specs in which field may
    be a range LO-HI (the Shape holds HI)."""
    out = []
    for spec in filter(None, (s.strip() for s in text.split(";"))):
        fields, lo = [], None
        for item in spec.split(","):
            key, _, value = item.partition("=")
            if key.strip() == field and "-" in value:
                low, _, high = value.partition("-")
                lo, item = parse_int(low), f"{field}={high}"
            fields.append(item)
        out += [(spec, shape, lo) for shape in parse_shapes(",".join(fields))]
    return out


def parse_serving(text):
    """'b=8,hq=32,L=2k-8k;b=1,L=32k' -> [Serving]: parse_shapes' specs whose L may be a
    range LO-HI of sequence lengths (one value: every sequence that long); seqlen_q 1."""
    out = []
    for spec, shape, lo in ranged_specs(text, "L"):
        if shape.sq != 1:
            raise ValueError(f"serving shapes decode one token (sq=1): {spec!r}")
        if lo is not None and not 1 <= lo <= shape.L:
            raise ValueError(f"bad length range in {spec!r}: use L=LO-HI with 1 <= LO <= HI")
        out.append(Serving(shape, shape.L if lo is None else lo))
    return out


Ragged = namedtuple("Ragged", "shape lo")  # a --ragged shape: query lengths lo..shape.sq


def parse_ragged(text):
    """'b=8,L=4k,sq=8;b=32,sq=4-4' -> [Ragged]: parse_shapes' specs whose sq is the longest
    query length, the batch's lengths drawn from 1..sq, or from LO..HI with sq=LO-HI."""
    out = []
    for spec, shape, lo in ranged_specs(text, "sq"):
        lo = 1 if lo is None else lo
        if not 1 <= lo <= shape.sq <= 16:
            raise ValueError(f"bad query lengths in {spec!r}: use sq=HI or sq=LO-HI with 1 <= LO <= HI <= 16")
        out.append(Ragged(shape, lo))
    return out


def ragged_label(r):
    """'32/8 d128 b=8 L=4096 sq=1-8'."""
    b, hq, hkv, d, L, sq = r.shape
    return f"{hq}/{hkv} d{d} b={b} L={L} sq={sq if r.lo == sq else f'{r.lo}-{sq}'}"


def serving_label(s):
    """'32/8 d128 b=8 L=2048-8192' (one length: 'L=32768')."""
    b, hq, hkv, d, L, _ = s.shape
    return f"{hq}/{hkv} d{d} b={b} L={L if s.lo == L else f'{s.lo}-{L}'}"


def ragged_lengths(b, lo, hi, seed):
    """b sequence lengths drawn uniformly from [lo, hi] by a generator seeded with seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (b,), generator=g).tolist()


def attended_bytes(lengths, hkv, d, itemsize):
    """Bytes of K and V that sequences of these lengths attend: the keys held, not the pages."""
    return 2 * sum(lengths) * hkv * d * itemsize


def even_lengths(lengths):
    """The same keys spread over the same sequences as evenly as they go."""
    q, r = divmod(sum(lengths), len(lengths))
    return tuple(q + (i < r) for i in range(len(lengths)))


def matrix_cases(matrix, dtypes=None):
    """[(Shape, dtype name)]: the matrix's own dtypes, or each shape in each of dtypes."""
    cases = [(s, dt) for dt, spec in matrix for s in parse_shapes(spec)]
    if dtypes:
        shapes = list(dict.fromkeys(s for s, _ in cases))
        cases = [(s, dt) for s in shapes for dt in dtypes]
    return cases


def _csv_arg(choices):
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"]
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(choices)}")
        return items
    return parse


def _splits_arg(text):
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"num_splits must be 0 (the planner's choice) or more: {text!r}")
    return values


def _positive_arg(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more: {text!r}")
    return value


def _seconds_arg(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"seconds must be 0 or more: {text!r}")
    return value


def _parsed_arg(parse):
    """An argparse type from a parser that raises ValueError; 'none' is []."""
    def arg(text):
        if text.strip() == "none":
            return []
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return arg


_shapes_arg, _lengths_arg = _parsed_arg(parse_shapes), _parsed_arg(parse_lengths)


def serving_cases(matrix, dtypes=None, kv=None):
    """[(Serving, q dtype, cache dtype or None)]: a serving matrix's own dtypes, or each of
    its shapes in each of dtypes with caches in kv."""
    cases = [(s, dt, k) for dt, k, spec in matrix for s in parse_serving(spec)]
    if dtypes:
        shapes = list(dict.fromkeys(s for s, _, _ in cases))
        cases = [(s, dt, kv) for s in shapes for dt in dtypes]
    return cases


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="flash-decode-bench", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[1:13]))
    p.add_argument("--shapes", type=_shapes_arg, action="append",
                   help="shape specs, e.g. 'b=1,hq=32,hkv=8,d=128,L=32768,sq=1'; ';' separates "
                        "shapes, '/' lists alternatives, 'none' runs no table case (default: the "
                        "built-in matrix)")
    p.add_argument("--dtypes", type=_csv_arg(DTYPES), help="fp16,bf16 (default: per the matrix; fp16 for --shapes)")
    p.add_argument("--peers", type=_csv_arg(PEERS), default=list(PEERS),
                   help=f"comma list of {','.join(PEERS)}, or none (default: all)")
    p.add_argument("--quick", action="store_true", help="a handful of shapes, for smoke tests")
    p.add_argument("--repeats", type=_positive_arg, default=20, help="graph replays per measurement (median)")
    p.add_argument("--out", type=Path, default=Path("flash-decode-bench"), help="output folder")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    p.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                   help="cache layout: bhsd (SDPA's; flash_decode gets views) or bshd (the reverse)")
    p.add_argument("--num-splits", type=_splits_arg, default=[], metavar="N,N,...",
                   help="also time flash_decode at each of these num_splits (a sweep, e.g. "
                        "'1,2,4,8,16,32'; combine with --peers none for a sweep alone)")
    p.add_argument("--read-same-bytes", action="store_true",
                   help="also time the Triton streaming read over each case's own K/V bytes, same "
                        "layers and graph timing: what a plain read reaches at that size, its fixed "
                        "costs included (columns read_us, read_tbs, read_pct)")
    p.add_argument("--settle", type=_seconds_arg, default=SETTLE_S, metavar="SECONDS",
                   help="after each case, give its memory back to the driver and wait this long "
                        f"before the next (default {SETTLE_S}; 0 shows why: see settle())")
    p.add_argument("--serving-shapes", type=_shapes_arg, metavar="SPEC",
                   help="shapes for the serving cases (paged caches, append), or 'none' "
                        f"(default: '{SERVING_SHAPES}', '{SERVING_QUICK}' with --quick, none with --shapes)")
    p.add_argument("--lengths", type=_lengths_arg, default=[], metavar="SPEC",
                   help="batches of given lengths ('32768,1024*7;hq=8,hkv=1:4k*8': ';' separates "
                        "batches, LEN*N repeats, heads and head dim before a ':', 32/8 and d128 by "
                        "default), fp16, a cache_seqlens tensor: each timed "
                        "as planned (balanced by the lengths where the plan balances), at the plan's "
                        "own split count for every sequence (num_splits, never balanced), and both "
                        "again with the same keys in equal lengths; FlashInfer too where it is among "
                        "--peers (default: none)")
    p.add_argument("--kv-dtype", choices=tuple(KV_DTYPES), metavar="|".join(KV_DTYPES),
                   help="fp8 caches (q in --dtypes) with a (batch, nheads_kv) descale: the fp8 table "
                        "(default shapes: its own matrix), each row with flash_decode on the same shape "
                        "in q's dtype; the SDPA peers do not take fp8; no serving cases (default: caches in "
                        "q's dtype)")
    p.add_argument("--paged16", action="store_true",
                   help="also time flash_decode and FlashInfer on a shuffled pool of 16-key pages holding "
                        "each case's keys (block_table, cache_seqlens, max_seqlen_k; the same pool for both)")
    p.add_argument("--sinks", action="store_true",
                   help="also time flash_decode with attention sinks (one fp32 logit a query head)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="also time flash_decode with batch_invariant=True on each case, checked like the default "
                        "call (column 'invariant / default')")
    p.add_argument("--serving-matrix", nargs="?", const="default", metavar="SPEC",
                   help="the serving matrix: ragged lengths (L=LO-HI, seeded) on shuffled pools of pages "
                        f"of {' and '.join(map(str, SERVING_PAGES))} keys and on a contiguous cache, "
                        "flash_decode and FlashInfer on the same pools, graph-timed; 'default' (the "
                        "built-in matrix, its quick one with --quick) or specs like 'b=8,L=2k-8k' in "
                        "--dtypes with --kv-dtype caches; alone unless --shapes asks for the table too")
    p.add_argument("--ragged", nargs="?", const="default", metavar="SPEC",
                   help="ragged query lengths: a batch whose query lengths are drawn from 1..sq (seeded; "
                        "sq=LO-HI from LO..HI) in one call with cu_seqlens_q and max_seqlen_q, beside the same "
                        "batch as uniform calls of each length (their times summed) and as one call padded to "
                        "the longest; causal, whole caches; 'default' (the built-in shapes, fewer with --quick) "
                        "or specs like 'b=8,L=4k,sq=8' in --dtypes; alone unless --shapes is given")
    p.add_argument("--seed", type=int, default=0, help="seed of the serving matrix's and --ragged's lengths and pages")
    args = p.parse_args(argv)
    if args.serving_matrix is None:
        args.serving_cases = []
    elif args.serving_matrix == "default":
        args.serving_cases = serving_cases(SERVING_MATRIX_QUICK if args.quick else SERVING_MATRIX, args.dtypes,
                                           args.kv_dtype)
    else:
        try:
            args.serving_cases = [(s, dt, args.kv_dtype) for s in parse_serving(args.serving_matrix)
                                  for dt in args.dtypes or ["fp16"]]
        except ValueError as err:
            p.error(f"argument --serving-matrix: {err}")
    spec = (RAGGED_QUICK if args.quick else RAGGED_MATRIX) if args.ragged == "default" else args.ragged or ""
    try:
        args.ragged_cases = [(r, dt) for r in parse_ragged(spec) for dt in args.dtypes or ["fp16"]]
    except ValueError as err:
        p.error(f"argument --ragged: {err}")
    # --serving-matrix and --ragged run alone unless --shapes asks for more
    alone = (args.serving_cases or args.ragged_cases) and not args.shapes
    if args.serving_shapes is None:
        args.serving_shapes = [] if args.shapes or args.kv_dtype or alone else \
            parse_shapes(SERVING_QUICK if args.quick else SERVING_SHAPES)
    if alone:
        args.cases = []
    elif args.shapes:
        args.cases = [(s, dt) for s in itertools.chain(*args.shapes) for dt in args.dtypes or ["fp16"]]
    elif args.kv_dtype:
        args.cases = matrix_cases(FP8_QUICK if args.quick else FP8_MATRIX, args.dtypes)
    else:
        args.cases = matrix_cases(QUICK_MATRIX if args.quick else DEFAULT_MATRIX, args.dtypes)
    return args


# ---- arithmetic ----

def cache_dtype(dtype, kv=None):
    """The caches' torch dtype: kv's (an fp8 name) where given, else q's."""
    return KV_DTYPES[kv] if kv else DTYPES[dtype]


def kv_bytes(shape, dtype, kv=None):
    """Bytes of K and V read per call."""
    return 2 * shape.b * shape.L * shape.hkv * shape.d * cache_dtype(dtype, kv).itemsize


def tbs(nbytes, us):
    return nbytes / us / 1e6


def layer_count(cache_bytes, free_bytes, layer_bytes=None):
    """max(3, 240 MB / cache) layers, capped to 40% of free memory (0: does not fit);
    layer_bytes: what a layer allocates, when more than the cache bytes a call reads."""
    want = max(3, math.ceil(L2_ROTATION_BYTES / cache_bytes))
    return min(want, int(MEMORY_FRACTION * free_bytes // (layer_bytes or cache_bytes)))


def geomean(values):
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


# ---- timing ----

def _event_median(run, calls, repeats):
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def time_kernel(call, layers, repeats):
    """(µs per call, how): a CUDA graph of calls over the layers in rotation,
    replayed between events; eager event timing if capture fails."""
    calls = len(layers) * math.ceil(MIN_CALLS / len(layers))
    run_all = lambda: [call(layers[i % len(layers)]) for i in range(calls)]  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for kv in layers[:2]:
            call(kv)
    torch.cuda.current_stream().wait_stream(side)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
    except Exception as err:  # noqa: BLE001 (some peer cannot be captured)
        torch.cuda.synchronize()
        return _event_median(run_all, calls, repeats), f"eager-timed: {_reason(err)}"
    us = _event_median(graph.replay, calls, repeats)
    del graph
    return us, "graph"


def time_eager(call, layers, calls=50):
    """µs per plain call (host overhead included), synchronized at the end."""
    call(layers[0])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        call(layers[i % len(layers)])
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


if triton is not None:
    @triton.jit
    def _read_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        x = tl.load(x_ptr + pid * BLOCK + tl.arange(0, BLOCK))
        tl.store(out_ptr + pid, tl.sum(x.to(tl.float32), axis=0))


def triton_read(numel, block=8192):
    """A call that streams the first numel (a multiple of block) elements of a
    1-D tensor through the Triton read kernel."""
    partial = torch.empty(numel // block, device="cuda", dtype=torch.float32)
    return lambda x: _read_kernel[(numel // block,)](x, partial, BLOCK=block, num_warps=8)


def read_ceiling(repeats, buffers=4, block=8192):
    """Streaming-read TB/s per method over rotating buffers of up to 1 GiB each."""
    free = torch.cuda.mem_get_info()[0]
    numel = min(1 << 29, int(MEMORY_FRACTION * free / buffers / 2)) // block * block
    bufs = [torch.randn(numel, device="cuda", dtype=torch.float16) for _ in range(buffers)]
    methods = {"torch.sum": lambda x: x.sum(dtype=torch.float32)}
    if triton is not None:
        methods["triton"] = triton_read(numel, block)
    return {name: tbs(numel * 2, time_kernel(fn, bufs, repeats)[0]) for name, fn in methods.items()}


def settle(seconds):
    """Give the freed cases' memory back to the driver, then wait before timing more.

    For some milliseconds after a large cudaFree, the driver's own work on the
    freed memory slows every kernel's reads. On the H200 the same b=32, 1024-token
    caches took 37.8-38.3 us a call for the first 15 ms after 6.4 GB were freed
    (and 7 ms after 2 GB), then 33.9-34.9 us; cuDNN on them 38.7-39.2 us, then
    34.9-35.9. A case times flash_decode first and its peers after, so without
    the pause the first library timed after a large case pays for it; a serving
    process, which allocates its caches once, never does.
    """
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    time.sleep(seconds)


def layer_bytes(kvs, block=8192, nbytes=None):
    """Per layer, one 1-D view over its K and V storage (make_tensors puts a
    layer's V right after its K), its first nbytes (default all), as 2-byte
    elements (fp8 bytes read as fp16) cut to a multiple of block; [] if that is
    less than a block."""
    views = []
    for k, v in kvs:
        if v.storage_offset() != k.storage_offset() + k.numel():
            raise ValueError("a layer's V does not follow its K in memory")
        size = 2 * k.numel() * k.element_size()
        numel = min(size, nbytes or size) // 2 // block * block
        if numel == 0:
            return []
        flat = k.as_strided((2 * k.numel(),), (1,), k.storage_offset())
        views.append((flat.view(torch.float16) if k.element_size() == 1 else flat)[:numel])
    return views


# ---- one case ----

def _reason(err):
    return str(err).strip().split("\n")[0][:100] or type(err).__name__


def random_cache(size, dt, device="cuda"):
    """Normal random values (layers, ...) of dt; fp8 rounded from fp16 a layer at a time."""
    if dt.itemsize > 1:
        return torch.randn(size, device=device, dtype=dt)
    buf = torch.empty(size, device=device, dtype=dt)
    for x in buf:
        x.copy_(torch.randn(x.shape, device=device, dtype=torch.float16))
    return buf


def fp8_descales(b, hkv, kv, device="cuda", seed=0):
    """flash_decode's keyword arguments for caches of kv: k_descale and v_descale as
    (b, hkv) fp32 tensors drawn from DESCALE_RANGE (seeded); {} for caches in q's dtype."""
    if not kv:
        return {}
    g = torch.Generator().manual_seed(seed)
    lo, hi = DESCALE_RANGE
    return {name: (lo + (hi - lo) * torch.rand(b, hkv, generator=g)).to(device) for name in ("k_descale", "v_descale")}


def dequantized(x, descale, nb=4):
    """The first nb sequences of a (b, L, hkv, d) cache as fp32 attended values: x * descale[b, h]."""
    x = x[:nb].float()
    return x * descale[:nb, None, :, None] if descale is not None else x


def make_tensors(shape, dtype, layers, layout, kv=None):
    """q and the layers' (k, v) in SDPA's (b, h, s, d) view and flash_decode's (b, s, h, d);
    the caches in kv (an fp8 name) where given, else in q's dtype."""
    b, hq, hkv, d, L, sq = shape
    dt = DTYPES[dtype]
    bhsd = layout == "bhsd"
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dt) if bhsd else \
        torch.randn(b, sq, hq, d, device="cuda", dtype=dt).transpose(1, 2)
    buf = random_cache((layers, 2, b, *((hkv, L) if bhsd else (L, hkv)), d), cache_dtype(dtype, kv))
    kvs = [(buf[i, 0], buf[i, 1]) if bhsd else (buf[i, 0].transpose(1, 2), buf[i, 1].transpose(1, 2))
           for i in range(layers)]
    ours = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in kvs]
    return q, kvs, q.transpose(1, 2), ours


def matches(out, ref, dtype):
    """(ok, max abs error) of out (b, h, s, d), first sequences, against the fp32 reference."""
    atol, rtol = TOL[DTYPES[dtype]]
    err = (out[:ref.shape[0]].float() - ref).abs()
    return bool((err <= atol + rtol * ref.abs()).all()), err.max().item()


def reference(q, k, v, nb=4, causal=False):
    """fp32 SDPA of the first nb sequences (b, h, s, d); causal aligns the last query
    row with the last key (query i sees keys up to L - sq + i)."""
    mask = None
    if causal:
        sq, L = q.shape[2], k.shape[2]
        mask = torch.ones(sq, L, dtype=torch.bool, device=q.device).tril(L - sq)
    with sdpa_kernel([SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q[:nb].float(), k[:nb].float(), v[:nb].float(),
                                              attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def with_sinks(ref, q, k, sinks):
    """ref (b, hq, sq, d), the fp32 attention of q over keys k (b, hkv, L, d, attended
    values), as it is when sinks (hq,) join each row's softmax denominator: scaled by
    sum exp(s) / (sum exp(s) + exp(sink)) = sigmoid(lse - sink)."""
    nb, hq, _, d = ref.shape
    kk = k[:nb].float().repeat_interleave(hq // k.shape[1], 1)
    lse = torch.logsumexp(q[:nb].float() @ kk.transpose(-1, -2) / math.sqrt(d), -1, keepdim=True)
    return ref * torch.sigmoid(lse - sinks.view(1, hq, 1, 1))


@functools.cache
def compiled_flex():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention
    torch._logging.set_logs(dynamo=logging.CRITICAL, inductor=logging.CRITICAL)  # failures: n/a rows
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):  # one compile per shape, many shapes
            setattr(torch._dynamo.config, name, 4096)
    return torch.compile(flex_attention, dynamic=False)


def peer_call(name, q, gqa):
    if name == "flex":
        flex = compiled_flex()
        return lambda kv: flex(q, kv[0], kv[1], enable_gqa=gqa)
    backend = SDPA_BACKENDS[name]

    def call(kv):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=gqa)
    return call


def flashinfer_decode(fi, workspace, tables, heads, page, dt, tensor_cores, kv_dt=None):
    """FlashInfer's decode wrapper over NHD pages of page keys, planned for tables
    (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len) and heads (hq, hkv, d);
    q in dt, the caches in kv_dt (default dt). Its fp8 runs take no k_scale/v_scale
    (1: no extra pass over out), so its reference is the fp8 values as they are."""
    w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
    w.plan(*tables, *heads, page, q_data_type=dt, kv_data_type=kv_dt or dt)
    return w


FLASHINFER_UNBUILT = {}  # (tensor cores, q dtype, cache dtype, head dim): why its module did not build


def flashinfer_decodes(fi, workspace, tables, qo, layers, page, name, kv_dt=None):
    """[(name, call, layers)]: FlashInfer's decode wrapper, CUDA cores and tensor cores, over
    layers of NHD pages of page keys for tables; qo (b, hq, d) in q's dtype. A variant whose
    plan fails gets a call that raises why, so the other still runs; a module that failed to
    build (FlashInfer compiles it in plan) is not tried again in this process, since each
    try costs minutes."""
    heads = (qo.shape[1], layers[0][0].shape[2], qo.shape[2])
    variants = []
    for tc in (False, True):
        key = (tc, qo.dtype, kv_dt or qo.dtype, heads[2])
        try:
            if key in FLASHINFER_UNBUILT:
                raise RuntimeError(f"did not build before: {FLASHINFER_UNBUILT[key]}")
            w = flashinfer_decode(fi, workspace, tables, heads, page, qo.dtype, tc, kv_dt)
            call = lambda kv, w=w: w.run(qo, kv)  # noqa: E731
        except Exception as exc:  # noqa: BLE001
            if key not in FLASHINFER_UNBUILT and re.search("ninja|nvcc|compil|build", str(exc), re.I):
                FLASHINFER_UNBUILT[key] = _reason(exc)
            call = _raises(exc)
        variants.append((f"{name}, {'tensor cores' if tc else 'no tensor cores'}", call, layers))
    return variants


def _raises(exc):
    def call(*_):
        raise exc
    return call


def flashinfer_variants(fi, workspace, q, kvs, shape, dtype, kv=None):
    """[(name, call, layers)]: FlashInfer over NHD paged views of the layers, per page
    size (16, and L: one page per sequence) and, for seqlen_q 1, with the decode
    wrapper's tensor cores off and on; for seqlen_q > 1 the causal prefill wrapper.
    q is (b, hq, sq, d), kvs the (b, hkv, L, d) layers; copies, where a layer is not
    contiguous in (b, L, hkv, d), are made here, outside the timed region."""
    b, hq, hkv, d, L, sq = shape
    dt, kv_dt = DTYPES[dtype], cache_dtype(dtype, kv)
    dev = q.device
    qo = q.transpose(1, 2).reshape(b * sq, hq, d).contiguous()  # (b * sq, hq, d) rows
    ours = [(k.transpose(1, 2), v.transpose(1, 2)) for k, v in kvs]
    if not ours[0][0].is_contiguous():  # one copy per layer, as many as fit, like expanded K/V
        n = layer_count(kv_bytes(shape, dtype, kv), torch.cuda.mem_get_info(dev)[0])
        if n < 1:
            raise MemoryError("contiguous copies of the caches would not fit")
        ours = [(k.contiguous(), v.contiguous()) for k, v in ours[:n]]
    variants = []
    for page in (p or L for p in FLASHINFER_PAGES):
        if L % page:
            continue
        name = "page16" if page == 16 else "one page per sequence" if page == L else f"page{page}"
        layers = [(paged_view(k, page), paged_view(v, page)) for k, v in ours]
        indptr, indices, last = paged_indices(b, L, page, device=dev)
        if sq == 1:
            variants += flashinfer_decodes(fi, workspace, (indptr, indices, last), qo, layers, page, name, kv_dt)
        else:
            qo_indptr = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=dev)
            w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page, causal=True,
                   q_data_type=dt, kv_data_type=kv_dt)
            variants.append((f"{name}, causal prefill", lambda kv, w=w: w.run(qo, kv), layers))
    return variants


def run_flashinfer(q, kvs, ref, shape, dtype, repeats, kv=None):
    """(µs or None, note): the fastest FlashInfer variant that matches the fp32
    reference (causal for seqlen_q > 1), named in the note; n/a with the first
    reason when none does."""
    if import_flashinfer() is None:
        return None, "n/a (flashinfer not installed)"
    if shape.sq > 1:
        ref = reference(q, *kvs[0], nb=ref.shape[0], causal=True)

    def variants_of(fi, workspace):
        variants = flashinfer_variants(fi, workspace, q, kvs, shape, dtype, kv)
        if not variants:
            raise ValueError(f"cache length {shape.L} is not a multiple of 16")
        return variants
    return fastest_flashinfer(variants_of, lambda out: out.view(shape.b, shape.sq, shape.hq, shape.d).transpose(1, 2),
                              ref, dtype, repeats)


def fastest_flashinfer(variants_of, shaped, ref, dtype, repeats):
    """(µs or None, note): fastest_matching over variants_of(fi, workspace), FlashInfer's
    variants built (and planned, outside the timing) there; n/a where FlashInfer does not
    import or its variants cannot be built."""
    fi = import_flashinfer()
    if fi is None:
        return None, "n/a (flashinfer not installed)"
    try:
        variants = variants_of(fi, torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=ref.device))
    except Exception as exc:  # noqa: BLE001
        return None, f"n/a ({_reason(exc)})"
    return fastest_matching(variants, shaped, ref, dtype, repeats)


def fastest_matching(variants, shaped, ref, dtype, repeats):
    """(µs, note naming it) of the fastest of variants [(name, call, layers)] whose output
    on its first layer, shaped like ref by shaped(), matches ref; else (None, n/a with the
    first reason)."""
    best, reason = None, None
    for name, call, layers in variants:
        try:
            ok, err = matches(shaped(call(layers[0])), ref, dtype)
            if not ok:
                reason = reason or f"{name}: mismatch: max error {err:.3g}"
                continue
            us, how = time_kernel(call, layers, repeats)
        except Exception as exc:  # noqa: BLE001 (a variant that cannot run: try the others)
            reason = reason or f"{name}: {_reason(exc)}"
            continue
        if best is None or us < best[0]:
            best = (us, f"{name}, {how}")
    return best if best else (None, f"n/a ({reason})")


def run_peer(name, q, kvs, ref, shape, dtype, repeats, kv=None):
    """(µs or None, note): GQA natively, else on expanded K/V; n/a with the reason.
    FlashInfer takes GQA natively, on paged views (see run_flashinfer); fp8 caches
    (kv) only it."""
    if name == "flashinfer":
        return run_flashinfer(q, kvs, ref, shape, dtype, repeats, kv)
    if kv:
        return None, "n/a (no fp8 cache)"
    group = shape.hq // shape.hkv
    reason = None
    for mode in ("gqa", "expanded") if group > 1 else ("mha",):
        layers = kvs
        if mode == "expanded":
            n = layer_count(kv_bytes(shape, dtype) * group, torch.cuda.mem_get_info()[0])
            if n < 1:
                return None, f"n/a ({reason}; expanded K/V would not fit)"
            layers = [(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) for k, v in kvs[:n]]
        call = peer_call(name, q, mode == "gqa")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ok, err = matches(call(layers[0]), ref, dtype)
                if not ok:
                    return None, f"n/a (mismatch: max error {err:.3g})"
                us, how = time_kernel(call, layers, repeats)
            return us, mode if how == "graph" else f"{mode}, {how}"
        except Exception as exc:  # noqa: BLE001 (a peer that cannot run: report why)
            told = [str(w.message) for w in caught if not str(w.message).rstrip().endswith(":")]
            reason = reason or (told[-1].split("\n")[0][:100] if told else _reason(exc))
    return None, f"n/a ({reason})"


def plan_fields(shape, dtype, kv=None):
    """The planner's num_splits, whole_items and kernel for the table's call on shape."""
    extra = {"kv_dtype": KV_DTYPES[kv]} if kv else {}
    plan = flash_decode.plan(shape.b, shape.sq, shape.hq, shape.hkv, shape.d, shape.L, dtype=DTYPES[dtype], **extra)
    return dict(num_splits=plan["num_splits"], whole_items=plan.get("whole_items", 0), kernel=plan.get("kernel"))


def time_in_q_dtype(shape, dtype, args):
    """µs of flash_decode on shape with caches in q's dtype (fp8 rows' baseline), or None
    where they do not fit; its layers are freed on return."""
    n = layer_count(kv_bytes(shape, dtype), torch.cuda.mem_get_info()[0])
    if n < 1:
        return None
    _, _, q_ours, ours = make_tensors(shape, dtype, n, args.layout)
    return time_kernel(lambda layer: flash_decode.flash_decode(q_ours, layer[0], layer[1]), ours, args.repeats)[0]


def run_case(shape, dtype, peers, args):
    kv = args.kv_dtype
    nbytes = kv_bytes(shape, dtype, kv)
    row = dict(dtype=dtype, kv_dtype=kv or dtype, **shape._asdict(), kv_mb=round(nbytes / MB, 2))
    if kv:  # what fp8 gains: the same shape in q's dtype, in this run, before the fp8 layers exist
        row["same_dtype_us"] = time_in_q_dtype(shape, dtype, args)
        settle(args.settle)
    n = layer_count(nbytes, torch.cuda.mem_get_info()[0])
    if n < 1:
        return dict(row, check=f"n/a (cache of {nbytes / 1e9:.1f} GB does not fit)")
    q, kvs, q_ours, ours = make_tensors(shape, dtype, n, args.layout, kv)
    fp8 = fp8_descales(shape.b, shape.hkv, kv, q.device)
    ref = reference(q, *kvs[0])  # the caches' values as stored: the peers' reference (FlashInfer: no descale)

    def attended(nb):  # the first nb sequences' K and V as flash_decode attends them, (b, hkv, L, d) fp32
        return [dequantized(x, fp8.get(name), nb).transpose(1, 2)
                for x, name in zip(ours[0], ("k_descale", "v_descale"))]
    ref_ours = reference(q, *attended(len(ref))) if kv else ref
    ours_call = lambda layer, **kw: flash_decode.flash_decode(q_ours, layer[0], layer[1], **fp8, **kw)  # noqa: E731
    row["layers"] = n
    try:
        row.update(plan_fields(shape, dtype, kv))
    except Exception as exc:  # noqa: BLE001 (the plan is reported, the call still timed)
        row["plan_note"] = f"n/a ({type(exc).__name__}: {_reason(exc)})"
    try:
        ok, err = matches(ours_call(ours[0]).transpose(1, 2), ref_ours, dtype)
        row["check"] = "ok" if ok else f"MISMATCH: max error {err:.3g}"
    except Exception as exc:  # noqa: BLE001 (report it, still time the peers)
        row["check"] = f"n/a ({type(exc).__name__}: {_reason(exc)})"
    if row["check"] == "ok":
        row["ours_us"], row["ours_timing"] = time_kernel(ours_call, ours, args.repeats)
        row["ours_tbs"] = tbs(nbytes, row["ours_us"])
        row["ours_pct"] = 100 * row["ours_tbs"] / args.ceiling
        row["ours_eager_us"] = time_eager(ours_call, ours)
        if args.num_splits:  # the same timing at each requested split count
            row["sweep_us"] = {n: time_kernel(functools.partial(ours_call, num_splits=n), ours, args.repeats)[0]
                               for n in args.num_splits}
        if args.sinks:
            row.update(time_sinks(ours_call, ours, q, attended(1)[0], ref_ours[:1], dtype, args.repeats))
        if args.batch_invariant:  # the same call in the invariant mode, same layers, same run
            row.update(time_option("invariant", ours_call, ours, ref_ours, dtype, args.repeats, batch_invariant=True))
    flat = layer_bytes(kvs) if args.read_same_bytes and triton is not None else []
    if flat:  # the same bytes, layers and timing through a plain streaming read
        row["read_us"] = time_kernel(triton_read(flat[0].numel()), flat, args.repeats)[0]
        row["read_tbs"] = tbs(flat[0].numel() * flat[0].element_size(), row["read_us"])
        row["read_pct"] = 100 * row["read_tbs"] / args.ceiling
    gqa = shape.hq != shape.hkv
    try:  # plain eager SDPA, default backend choice
        if not kv:
            row["sdpa_eager_us"] = time_eager(lambda kv: F.scaled_dot_product_attention(q, *kv, enable_gqa=gqa), kvs)
    except Exception as exc:  # noqa: BLE001
        row["sdpa_eager_note"] = f"n/a ({_reason(exc)})"
    for name in peers:
        us, row[f"{name}_note"] = run_peer(name, q, kvs, ref, shape, dtype, args.repeats, kv)
        if us is not None:
            row.update({f"{name}_us": us, f"{name}_tbs": tbs(nbytes, us)})
            if row.get("ours_us"):
                row[f"{name}_ratio"] = us / row["ours_us"]
    return row


def time_sinks(call, layers, q, k, ref, dtype, repeats):
    """{sinks_us, sinks_check}: call with sinks (one fp32 logit a query head), checked
    against ref (q's first sequences) rescaled for them (with_sinks), then timed. The
    sinks are near log(keys), where exp(sink) weighs as much as the scores' sum does,
    so a call that dropped them would not pass."""
    sinks = torch.randn(q.shape[1], device=q.device, dtype=torch.float32) + math.log(k.shape[2])
    return time_option("sinks", call, layers, with_sinks(ref, q, k, sinks), dtype, repeats, sinks=sinks)


def time_option(name, call, layers, ref, dtype, repeats, **options):
    """{name_us, name_check}: call(layer, **options), its output (b, s, h, d) checked against
    ref (the first sequences, (nb, h, s, d) fp32), then graph-timed over the layers."""
    out = {}
    try:
        ok, err = matches(call(layers[0], **options).transpose(1, 2), ref, dtype)
        out[f"{name}_check"] = "ok" if ok else f"MISMATCH: max error {err:.3g}"
        if ok:
            out[f"{name}_us"] = time_kernel(functools.partial(call, **options), layers, repeats)[0]
    except Exception as exc:  # noqa: BLE001
        out[f"{name}_check"] = f"n/a ({type(exc).__name__}: {_reason(exc)})"
    return out


def paged16_columns(shape, dtype, kv, peers, args):
    """{paged16_*, fi_paged16_*}: flash_decode and FlashInfer on a shuffled pool of 16-key
    pages holding each sequence's L keys (run_pool); seqlen_q 1 only (FlashInfer's decode)."""
    if shape.sq != 1:
        return dict(paged16_check="n/a (seqlen_q > 1)")
    q = torch.randn(shape.b, 1, shape.hq, shape.d, device="cuda", dtype=DTYPES[dtype])
    r = run_pool(q, [shape.L] * shape.b, 16, shape.hkv, dtype, kv, args.repeats, peers, args.seed)
    return {("fi_paged16_" + k[3:] if k.startswith("fi_") else f"paged16_{k}"): v for k, v in r.items()}


def run_pool(q, lengths, page, hkv, dtype, kv, repeats, peers=(), seed=0, read=False):
    """flash_decode on sequences of the given lengths, graph-timed over rotating layers:
    paged (page > 0: a shuffled pool of pages, shuffled_pages; block_table, cache_seqlens
    on the GPU, max_seqlen_k) or contiguous (page 0: (b, longest, hkv, d) caches, the same
    lengths). With flashinfer among peers, FlashInfer's decode (CUDA and tensor cores, the
    faster reported) on the same pools, planned with the same lengths on the host. read:
    also a plain read of the bytes attended (attended_bytes) over the same layers.
    Returns {us, layers, check, fi_us, fi_note, read_us}, what applies."""
    b, _, hq, d = q.shape
    kv_dt = cache_dtype(dtype, kv)
    table, fi_tables = shuffled_pages(lengths, page, torch.Generator().manual_seed(seed)) if page else (None, None)
    # the pool (pages, page, hkv, d), or the contiguous (b, longest, hkv, d) caches
    size = (len(fi_tables[1]), page) if page else (b, max(lengths))
    attended = attended_bytes(lengths, hkv, d, kv_dt.itemsize)
    n = layer_count(attended, torch.cuda.mem_get_info(q.device)[0], 2 * math.prod(size) * hkv * d * kv_dt.itemsize)
    if n < 1:
        return dict(check="n/a (does not fit)")
    buf = random_cache((n, 2, *size, hkv, d), kv_dt, q.device)
    layers = [(buf[i, 0], buf[i, 1]) for i in range(n)]
    fp8 = fp8_descales(b, hkv, kv, q.device)
    kw = dict(cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=q.device), max_seqlen_k=max(lengths), **fp8)
    if page:
        kw["block_table"] = table.to(q.device)

    def call(layer):
        return flash_decode.flash_decode(q, layer[0], layer[1], **kw)

    k, v = dense((*layers[0], kw.get("block_table")), b, max(lengths))  # (b, longest, hkv, d) as stored
    stored = lengths_reference(q, k, v, lengths)  # FlashInfer's (no descale)
    ref = lengths_reference(q, dequantized(k, fp8["k_descale"], b), dequantized(v, fp8["v_descale"], b),
                            lengths) if kv else stored
    out = dict(layers=n)
    try:
        ok, err = matches(call(layers[0]), ref, dtype)
        out["check"] = "ok" if ok else f"MISMATCH: max error {err:.3g}"
        if ok:
            out["us"] = time_kernel(call, layers, repeats)[0]
    except Exception as exc:  # noqa: BLE001 (report it, still time FlashInfer)
        out["check"] = f"n/a ({type(exc).__name__}: {_reason(exc)})"
    if page and "flashinfer" in peers:  # planned on the host from the same pages and lengths
        out["fi_us"], out["fi_note"] = fastest_flashinfer(
            lambda fi, workspace: flashinfer_decodes(fi, workspace, [t.to(q.device) for t in fi_tables],
                                                     q.reshape(b, hq, d), layers, page, f"page{page}", kv_dt),
            lambda o: o.view(q.shape), stored, dtype, repeats)
    flat = layer_bytes(layers, nbytes=attended) if read and triton is not None else []
    if flat:
        out["read_us"] = time_kernel(triton_read(flat[0].numel()), flat, repeats)[0]
    return out


def serving_layers(shape, dtype, page, n, capacity=1):
    """n layers of (k_cache, v_cache, block_table or None) holding L keys per sequence:
    contiguous (b, capacity * L, hkv, d), or paged (ceil(L / page) pages a sequence, in a
    random order)."""
    b, _, hkv, d, L, _ = shape
    dt = DTYPES[dtype]
    layers = []
    for _ in range(n):
        if page:
            per_sequence = -(-L // page)
            k = torch.randn(b * per_sequence, page, hkv, d, device="cuda", dtype=dt)
            table = torch.randperm(b * per_sequence, device="cuda").to(torch.int32).view(b, per_sequence)
        else:
            k, table = torch.randn(b, capacity * L, hkv, d, device="cuda", dtype=dt), None
        layers.append((k, torch.randn_like(k), table))
    return layers


def dense(layer, b, L):
    """A layer's first L keys per sequence as contiguous (b, L, hkv, d) caches: a paged
    layer's gathered, a contiguous one's sliced."""
    k, v, table = layer
    if table is None:
        return k[:, :L], v[:, :L]
    # Gathered as bytes where the dtype is one byte: older torch cannot index fp8 tensors.
    return (gather_pages(x, table)[:, :L] for x in (k, v))


def gather_pages(x, table):
    """x's pages table (batch, pages) as (batch, pages * page_size, ...), fp8 included."""
    raw = x.view(torch.uint8) if x.element_size() == 1 else x
    return raw[table.long()].flatten(1, 2).view(x.dtype)


def run_serving_case(shape, dtype, case, repeats):
    """One serving case: µs per call (graph-timed over rotating layers), TB/s of the
    cache read, and a check against flash_decode on a contiguous copy of the same
    keys (paged) or on the cache after the append (append, without rotary)."""
    page, append, rotary, capacity, bound, ragged = SERVING_CASES[case]
    b, hq, hkv, d, L, sq = shape
    dt = DTYPES[dtype]
    held = serving_lengths(b, L, ragged)
    nbytes = kv_bytes(shape, dtype) * sum(held) // (b * L)  # what a call reads
    row = dict(case=case, dtype=dtype, **shape._asdict(), kv_mb=round(nbytes / MB, 2))
    if ragged and b == 1:
        return dict(row, check="n/a (one sequence)")
    n = layer_count(nbytes, torch.cuda.mem_get_info()[0], capacity * kv_bytes(shape, dtype))
    if n < 1:
        return dict(row, check=f"n/a (cache of {capacity * kv_bytes(shape, dtype) / 1e9:.1f} GB does not fit)")
    layers = serving_layers(shape, dtype, page, n, capacity)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=dt)
    lens = torch.tensor([x - sq if append else x for x in held], dtype=torch.int32, device="cuda")
    new = [torch.randn(b, sq, hkv, d, device="cuda", dtype=dt) for _ in range(2)] if append else []
    kw = dict(cache_seqlens=lens, causal=True)
    if bound:
        kw["max_seqlen_k"] = L
    if rotary:
        angles = torch.arange(L, device="cuda")[:, None] * 10000.0 ** (-torch.arange(0, d, 2, device="cuda") / d)
        kw.update(rotary_cos=angles.cos().to(dt), rotary_sin=angles.sin().to(dt), rotary_interleaved=False)

    def call(layer):
        return flash_decode.flash_decode(q, layer[0], layer[1], *new, block_table=layer[2], **kw)

    out = call(layers[0])
    if rotary:
        row["check"] = "-"
    else:
        k, v = dense(layers[0], b, L)  # with the appended keys in place, for append
        want = flash_decode.flash_decode(q, k, v, cache_seqlens=lens + (sq if append else 0), causal=True)
        err = (out.float() - want.float()).abs().max().item()
        row["check"] = "ok" if err <= TOL[dt][0] else f"MISMATCH: max error {err:.3g}"
    row["layers"] = n
    row["us"] = time_kernel(call, layers, repeats)[0]
    row["tbs"] = tbs(nbytes, row["us"])
    return row


def run_serving(args, log):
    """The serving cases of every --serving-shapes shape, each with its time over the
    contiguous case's ("x contiguous")."""
    rows = []
    for shape in args.serving_shapes:
        base = None
        for case in SERVING_CASES:
            try:
                row = run_serving_case(shape, "fp16", case, args.repeats)
            except Exception as err:  # noqa: BLE001 (report the case, go on)
                row = dict(case=case, dtype="fp16", **shape._asdict(), check=f"n/a ({type(err).__name__}: {_reason(err)})")
            if case == "contiguous":
                base = row.get("us")
            if base and row.get("us"):
                row["vs_contiguous"] = row["us"] / base
            rows.append(row)
            settle(args.settle)
            log(format_serving_row(row))
    return rows


def format_serving_row(r):
    text = f"serving {r['case']:<26} {label(Shape(*(r[f] for f in Shape._fields)))}"
    if "us" not in r:
        return text + f" | {r.get('check')}"
    return text + (f" | {r['us']:.1f}us {r['tbs']:.2f}TB/s | {r.get('vs_contiguous', 1):.2f}x contiguous"
                   f" | check {r['check']}")


def run_serving_row(serving, dtype, kv, args):
    """One serving-matrix shape: lengths drawn by ragged_lengths (args.seed), flash_decode on
    a contiguous cache of them (and the plain read of the bytes attended) and on shuffled
    pools of each SERVING_PAGES size, FlashInfer on the same pools (run_pool); each pool's
    time over the contiguous one's ("vs_contiguous"), FlashInfer's over flash_decode's."""
    shape, lo = serving
    b, hq, hkv, d, hi, _ = shape
    lengths = ragged_lengths(b, lo, hi, args.seed)
    nbytes = attended_bytes(lengths, hkv, d, cache_dtype(dtype, kv).itemsize)
    row = dict(dtype=dtype, kv_dtype=kv or dtype, b=b, hq=hq, hkv=hkv, d=d, lo=lo, hi=hi, keys=sum(lengths),
               kv_mb=round(nbytes / MB, 2))
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=DTYPES[dtype])
    for page in (0, *SERVING_PAGES):
        key = f"page{page}" if page else "contiguous"
        r = run_pool(q, lengths, page, hkv, dtype, kv, args.repeats, args.peers, args.seed, read=not page)
        row.update({f"{key}_{k}": v for k, v in r.items()})
        settle(args.settle)
        if page and r.get("us") and row.get("contiguous_us"):
            row[f"{key}_vs_contiguous"] = r["us"] / row["contiguous_us"]
        if r.get("us") and r.get("fi_us"):
            row[f"{key}_fi_ratio"] = r["fi_us"] / r["us"]
    if row.get("contiguous_us"):
        row["tbs"] = tbs(nbytes, row["contiguous_us"])
    return row


def run_serving_matrix(args, log):
    return run_each("serving", args.serving_cases, args, log,
                    lambda serving, dtype, kv: run_serving_row(serving, dtype, kv, args),
                    lambda serving, dtype, kv: dict(dtype=dtype, kv_dtype=kv or dtype, **serving.shape._asdict(),
                                                    lo=serving.lo, hi=serving.shape.L),
                    lambda row, serving, *_: format_serving_matrix_row(row, serving))


def run_each(what, cases, args, log, run, failed, line):
    """[row]: run(*case) for each case, or failed(*case) with the reason in its check where run
    raises (the case is reported, the others go on); each followed by a settle and a log line."""
    rows = []
    for i, case in enumerate(cases, 1):
        try:
            row = run(*case)
        except Exception as err:  # noqa: BLE001
            row = dict(failed(*case), check=f"n/a ({type(err).__name__}: {_reason(err)})")
        rows.append(row)
        settle(args.settle)
        log(f"[{what} {i}/{len(cases)}] " + line(row, *case))
    return rows


def format_serving_matrix_row(r, serving):
    text = f"{r['dtype']}/{r['kv_dtype']} {serving_label(serving)}"
    for key in ("contiguous", *(f"page{p}" for p in SERVING_PAGES)):
        if r.get(f"{key}_us"):
            text += f" | {key} {r[key + '_us']:.1f}us"
            if r.get(f"{key}_fi_us"):
                text += f", FlashInfer {r[key + '_fi_us']:.1f}us ({r[key + '_fi_ratio']:.3f}x)"
            elif r.get(f"{key}_fi_note"):
                text += f", FlashInfer {r[key + '_fi_note']}"
        else:
            text += f" | {key} {r.get(key + '_check', r.get('check'))}"
    if r.get("contiguous_read_us"):
        text += f" | read {r['contiguous_read_us']:.1f}us"
    return text


LENGTHS_TIMINGS = (  # (row key, equal lengths, requested split count)
    ("us", False, False), ("unbalanced_us", False, True), ("even_us", True, False), ("even_unbalanced_us", True, True))


def lengths_reference(q, k, v, lengths):
    """fp32 SDPA of each sequence of q (b, 1, hq, d) over its first lengths[i] keys of k
    and v (b, L, hkv, d); zeros for a sequence without keys (what flash_decode writes)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i, n in enumerate(lengths):
        if n:
            kv = [x[i:i + 1, :n].transpose(1, 2) for x in (k, v)]
            out[i] = reference(q[i:i + 1].transpose(1, 2), *kv, nb=1).transpose(1, 2)[0]
    return out


def run_lengths_case(batch, repeats, peers=(), device="cuda"):
    """One --lengths batch on a contiguous fp16 cache of its longest length, with that
    length as max_seqlen_k: µs per call as planned, with num_splits = the plan's own count
    (no balancing), and both for the same keys in equal lengths; TB/s of the keys held.
    Each of the four outputs is checked against fp32 SDPA per sequence. With flashinfer
    among peers, FlashInfer on the batch and on its equal lengths too."""
    lengths, hq, hkv, d = batch.lengths, batch.hq, batch.hkv, batch.d
    b, cap = len(lengths), max(lengths)
    shape = Shape(b, hq, hkv, d, cap, 1)
    nbytes = kv_bytes(shape, "fp16") * sum(lengths) // (b * cap)
    row = dict(lengths=",".join(map(str, lengths)), b=b, hq=hq, hkv=hkv, d=d, L=cap, keys=sum(lengths),
               kv_mb=round(nbytes / MB, 2))
    n = layer_count(nbytes, torch.cuda.mem_get_info()[0], kv_bytes(shape, "fp16"))
    if n < 1:
        return dict(row, check=f"n/a (cache of {kv_bytes(shape, 'fp16') / 1e9:.1f} GB does not fit)")
    # The plan of the calls below: max_seqlen_k = cap plans for the capacity itself (the bound
    # rounded up to a power of two, capped at the capacity).
    plan = flash_decode.plan(b, 1, hq, hkv, d, cap, seqlen=cap, lengths=True, device=None if device == "cuda" else -1)
    splits = plan.get("balance_splits", plan["num_splits"])  # the count equal lengths take
    row.update(layers=n, num_splits=splits, balanced="balance_splits" in plan, most_splits=plan["num_splits"])
    layers = [(k := torch.randn(b, cap, hkv, d, device=device, dtype=torch.float16), torch.randn_like(k))
              for _ in range(n)]
    q = torch.randn(b, 1, hq, d, device=device, dtype=torch.float16)
    bad = []
    for key, even, requested in LENGTHS_TIMINGS:
        held = even_lengths(lengths) if even else lengths
        lens = torch.tensor(held, dtype=torch.int32, device=device)
        kw = dict(cache_seqlens=lens, max_seqlen_k=cap, num_splits=splits if requested else 0)

        def call(layer, kw=kw):
            return flash_decode.flash_decode(q, layer[0], layer[1], **kw)

        ok, err = matches(call(layers[0]), lengths_reference(q, *layers[0], held), "fp16")
        if not ok:
            bad.append(f"{key[:-3]} max error {err:.3g}")
        row[key] = time_kernel(call, layers, repeats)[0]
    row["check"] = "ok" if not bad else "MISMATCH: " + ", ".join(bad)
    row["tbs"] = tbs(nbytes, row["us"])
    if "flashinfer" in peers:
        for key, held in (("flashinfer", lengths), ("flashinfer_even", even_lengths(lengths))):
            row[f"{key}_us"], row[f"{key}_note"] = run_flashinfer_lengths(q, layers, held, repeats)
    return row


def run_flashinfer_lengths(q, layers, lengths, repeats):
    """(µs or None, note): FlashInfer's decode wrapper on a --lengths batch (its page table
    from the lengths, planned on the host), pages of 16 and one page per sequence, tensor
    cores off and on: the fastest variant that matches fp32 SDPA, named in the note."""
    if min(lengths) < 1:
        return None, "n/a (a sequence without keys)"
    cap = layers[0][0].shape[1]

    def variants_of(fi, workspace):
        variants = []
        for page in (16, cap):
            if cap % page:
                continue
            paged = [(paged_view(k, page), paged_view(v, page)) for k, v in layers]
            tables = ragged_paged_indices(lengths, cap, page, device=q.device)
            variants += flashinfer_decodes(fi, workspace, tables, q.reshape(q.shape[0], *q.shape[2:]), paged, page,
                                           "page16" if page == 16 else "one page per sequence")
        return variants
    return fastest_flashinfer(variants_of, lambda out: out.view(q.shape), lengths_reference(q, *layers[0], lengths),
                              "fp16", repeats)


def run_lengths(args, log):
    rows = []
    for batch in args.lengths:
        try:
            row = run_lengths_case(batch, args.repeats, args.peers)
        except Exception as err:  # noqa: BLE001 (report the batch, go on)
            row = dict(lengths=",".join(map(str, batch.lengths)), b=len(batch.lengths), hq=batch.hq, hkv=batch.hkv,
                       d=batch.d, check=f"n/a ({type(err).__name__}: {_reason(err)})")
        rows.append(row)
        settle(args.settle)
        log(format_lengths_row(row))
    return rows


def format_lengths_row(r):
    lengths = r["lengths"] if len(r["lengths"]) <= 40 else r["lengths"][:37] + "..."
    text = f"lengths b={r['b']},hq={r['hq']},hkv={r['hkv']},d={r['d']} [{lengths}]"
    if "us" not in r:
        return text + f" | {r.get('check')}"
    how = f"balanced, at most {r['most_splits']} splits" if r["balanced"] else "not balanced"
    text += (f" | {r['us']:.1f}us {r['tbs']:.2f}TB/s ({r['num_splits']} splits for equal lengths, {how})"
             f" | unbalanced {r['unbalanced_us']:.1f}us | equal lengths {r['even_us']:.1f}us,"
             f" unbalanced {r['even_unbalanced_us']:.1f}us | check {r['check']}")
    if "flashinfer_note" in r:
        fi = [f"{r[k + '_us']:.1f}us ({r[k + '_note']})" if r.get(k + "_us") else r[k + "_note"]
              for k in ("flashinfer", "flashinfer_even")]
        text += f" | FlashInfer {fi[0]}, equal lengths {fi[1]}"
    return text


def ragged_parts(qlens):
    """{query length: [sequence indices]}: the uniform calls a ragged batch splits into."""
    parts = {}
    for i, s in enumerate(qlens):
        parts.setdefault(s, []).append(i)
    return dict(sorted(parts.items()))


def run_ragged_case(ragged, dtype, repeats, seed=0, device="cuda"):
    """One --ragged batch over whole contiguous caches (b, L, hkv, d), causal: query lengths
    drawn by ragged_lengths, timed as one ragged call (q (total_q, hq, d), cu_seqlens_q,
    max_seqlen_q the longest), as uniform 4-D calls of each length (cache_batch_idx picks their
    caches; "parts_us" sums them) and as one 4-D call padded to the longest (each sequence's rows
    last, where bottom-right causal alignment leaves them); each checked per sequence against
    fp32 SDPA first. TB/s counts the caches' K and V bytes."""
    shape, lo = ragged
    b, hq, hkv, d, L, hi = shape
    dt = DTYPES[dtype]
    qlens = ragged_lengths(b, lo, hi, seed)
    top, starts = max(qlens), [0, *itertools.accumulate(qlens)]
    nbytes = kv_bytes(shape, dtype)
    row = dict(dtype=dtype, b=b, hq=hq, hkv=hkv, d=d, L=L, lo=lo, hi=hi, total_q=starts[-1],
               kv_mb=round(nbytes / MB, 2))
    n = layer_count(nbytes, torch.cuda.mem_get_info()[0])
    if n < 1:
        return dict(row, check=f"n/a (cache of {nbytes / 1e9:.1f} GB does not fit)")
    buf = random_cache((n, 2, b, L, hkv, d), dt, device)
    layers = [(buf[i, 0], buf[i, 1]) for i in range(n)]
    q = torch.randn(starts[-1], hq, d, device=device, dtype=dt)
    rows = [q[starts[i]:starts[i + 1]] for i in range(b)]  # each sequence's (s, hq, d) query rows
    padded = torch.zeros(b, top, hq, d, device=device, dtype=dt)
    for i, x in enumerate(rows):
        padded[i, top - len(x):] = x
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    # name -> (call, the rows of sequence i in its output, the sequences it holds)
    calls = {"ragged": (lambda layer: flash_decode.flash_decode(q, *layer, cu_seqlens_q=cu, max_seqlen_q=top,
                                                                causal=True),
                        lambda out, i: out[starts[i]:starts[i + 1]], range(b)),
             "padded": (lambda layer: flash_decode.flash_decode(padded, *layer, causal=True),
                        lambda out, i: out[i, top - qlens[i]:], range(b))}
    for s, seqs in ragged_parts(qlens).items():
        part = torch.stack([rows[i] for i in seqs])
        index = {} if seqs == list(range(b)) else dict(
            cache_batch_idx=torch.tensor(seqs, dtype=torch.int32, device=device))
        calls[f"part{s}"] = (lambda layer, part=part, index=index: flash_decode.flash_decode(
            part, *layer, causal=True, **index), lambda out, i, seqs=seqs: out[seqs.index(i)], seqs)
    k, v = layers[0]
    refs = [reference(x.transpose(0, 1)[None], k[i:i + 1].transpose(1, 2), v[i:i + 1].transpose(1, 2), nb=1,
                      causal=True) for i, x in enumerate(rows)]  # (1, hq, s, d) each
    bad, timed = [], {}
    for name, (call, rows_of, seqs) in calls.items():
        try:
            out = call(layers[0])
            results = [matches(rows_of(out, i).transpose(0, 1)[None], refs[i], dtype) for i in seqs]
            if not all(ok for ok, _ in results):
                bad.append(f"{name} max error {max(err for _, err in results):.3g}")
                continue
            timed[name] = time_kernel(call, layers, repeats)[0]
        except Exception as exc:  # noqa: BLE001 (the ragged call may not exist yet: time the others)
            bad.append(f"{name} n/a ({type(exc).__name__}: {_reason(exc)})")
    row.update(layers=n, qlens=",".join(map(str, qlens)), check="ok" if not bad else "; ".join(bad),
               ragged_us=timed.get("ragged"), padded_us=timed.get("padded"),
               parts={int(k[4:]): us for k, us in timed.items() if k.startswith("part")})
    if len(row["parts"]) == len(ragged_parts(qlens)):
        row["parts_us"] = sum(row["parts"].values())
    if row["ragged_us"]:
        row["tbs"] = tbs(nbytes, row["ragged_us"])
        for key in ("parts", "padded"):
            if row.get(f"{key}_us"):
                row[f"vs_{key}"] = row["ragged_us"] / row[f"{key}_us"]
    return row


def run_ragged(args, log):
    return run_each("ragged", args.ragged_cases, args, log,
                    lambda ragged, dtype: run_ragged_case(ragged, dtype, args.repeats, args.seed),
                    lambda ragged, dtype: dict(dtype=dtype, **ragged.shape._asdict(), lo=ragged.lo, hi=ragged.shape.sq),
                    lambda row, ragged, _: format_ragged_row(row, ragged))


def format_ragged_row(r, ragged):
    text = f"{r['dtype']} {ragged_label(ragged)}"
    if r.get("qlens"):
        text += f" [{r['qlens'] if len(r['qlens']) <= 40 else r['qlens'][:37] + '...'}]"
    for key, what in (("ragged_us", "ragged"), ("parts_us", "uniform parts"), ("padded_us", "padded")):
        if r.get(key):
            text += f" | {what} {r[key]:.1f}us"
    if r.get("vs_parts"):
        text += f" | ragged / parts {r['vs_parts']:.3f}x"
    if r.get("vs_padded"):
        text += f" | ragged / padded {r['vs_padded']:.3f}x"
    return text + f" | check {r.get('check')}"


def eager_tiny(calls=400, rounds=5):
    """Eager µs per call on TINY: flash_decode vs a plain torch SDPA call."""
    q, kvs, q_ours, ours = make_tensors(TINY, "fp16", 1, "bhsd")
    ours_call = lambda kv: flash_decode.flash_decode(q_ours, kv[0], kv[1])  # noqa: E731
    sdpa_call = lambda kv: F.scaled_dot_product_attention(q, *kv, enable_gqa=True)  # noqa: E731
    res = {who: statistics.median(time_eager(fn, layers, calls) for _ in range(rounds))
           for who, fn, layers in (("ours_us", ours_call, ours), ("sdpa_us", sdpa_call, kvs))}
    return dict(shape=label(TINY), dtype="fp16", **res, ratio=res["ours_us"] / res["sdpa_us"])


# ---- reporting (pure: tested on CPU) ----

# Cache-size bands (MB of K+V) for the share of the read ceiling.
SIZE_BANDS = (("caches < 64 MB", 0, 64), ("caches 64-256 MB", 64, 256), ("caches >= 256 MB", 256, math.inf))


def summarize(rows, eager):
    """[(what, value)]: how many shapes matched the fp32 reference; per peer, and for the
    plain read of the same bytes, the ratio of its time to flash_decode's (min, geomean,
    max: above 1x flash_decode is faster); the share of the read ceiling that
    flash_decode (and the plain read) reached, and flash_decode's speed as a share of the
    plain read's, per cache-size band; the eager call. Lines without data are left out."""
    def spread(values, fmt, centre, centre_name):
        if len(values) == 1:
            return f"{fmt.format(values[0])} (1 shape)"
        return (f"min {fmt.format(min(values))}, {centre_name} {fmt.format(centre(values))}, "
                f"max {fmt.format(max(values))} over {len(values)} shapes")

    ok = sum(r.get("check") == "ok" for r in rows)
    out = [("checked against fp32 SDPA", f"{ok}/{len(rows)} ok")]
    versus = [(f"vs {p} (its time / flash_decode's)", f"{p}_us", "ours_us") for p in BASE_PEERS + ("flashinfer",)]
    versus += [("vs a plain read of the same bytes (its time / flash_decode's)", "read_us", "ours_us"),
               ("vs FlashInfer on the same shuffled pages of 16 (its time / flash_decode's)", "fi_paged16_us",
                "paged16_us"),
               ("fp8 caches against the same shape in q's dtype (time / time)", "ours_us", "same_dtype_us"),
               ("with sinks against without (time / time)", "sinks_us", "ours_us"),
               ("batch_invariant=True against the default call (time / time)", "invariant_us", "ours_us")]
    for what, num, den in versus:  # each with data
        ratios = [r[num] / r[den] for r in rows if r.get(num) and r.get(den)]
        if ratios:
            out.append((what, spread(ratios, "{:.3f}x", geomean, "geomean")))
    # Per cache-size band: shares of the read ceiling, and of the practical
    # bound, the same bytes read plainly (None where a row lacks the figure).
    shares = (("flash_decode", "the read ceiling", lambda r: r.get("ours_pct")),
              ("plain read", "the read ceiling", lambda r: r.get("read_pct")),
              ("flash_decode", "the plain read's speed",
               lambda r: 100 * r["read_us"] / r["ours_us"] if r.get("read_us") and r.get("ours_us") else None))
    for who, of, share in shares:
        for band, lo, hi in SIZE_BANDS:
            pcts = [x for r in rows if lo <= r["kv_mb"] < hi and (x := share(r)) is not None]
            if pcts:
                out.append((f"{who}, {band}: share of {of}", spread(pcts, "{:.1f}%", statistics.median, "median")))
    out += fp8_bounds(rows)
    slower = [r["invariant_us"] / r["ours_us"] for r in rows if r.get("invariant_us") and r.get("ours_us")
              and r["kv_mb"] >= 64]
    if slower:
        out.append(("batch_invariant=True against the default call, caches >= 64 MB (time / time)",
                    spread(slower, "{:.3f}x", geomean, "geomean")))
    if eager:
        out.append((f"eager call on {eager['shape']}", f"flash_decode {eager['ours_us']:.1f} us, "
                    f"torch SDPA {eager['sdpa_us']:.1f} us ({eager['ratio']:.3f}x)"))
    return out


def _cell(key, fmt="{:.1f}"):
    return lambda r: fmt.format(r[key]) if r.get(key) is not None else "–"


def _ratio(num, den, fmt="{:.3f}", note=None):
    """A cell of r[num] / r[den] (with r[note] in brackets where given), or r[note] alone."""
    def cell(r):
        if r.get(num) and r.get(den):
            return fmt.format(r[num] / r[den]) + (f" ({r[note]})" if note and r.get(note) else "")
        return (r.get(note) or "–") if note else "–"
    return cell


def _dtypes(r):
    return r["dtype"] if r.get("kv_dtype", r["dtype"]) == r["dtype"] else f"{r['dtype']} / {r['kv_dtype']}"


def markdown(columns, rows):
    """A markdown table: columns [(header, align ('---' or '--:'), cell(row) -> str)]."""
    lines = ["| " + " | ".join(c[0] for c in columns) + " |", "| " + " | ".join(c[1] for c in columns) + " |"]
    return "\n".join(lines + ["| " + " | ".join(c[2](r) for c in columns) + " |" for r in rows])


PEER_NAMES = dict(cudnn="cuDNN", flash="flash", efficient="efficient", flex="flex",
                  flashinfer="FlashInfer (its fastest variant)")


def table_columns(rows, peers):
    """The main table's markdown columns; optional ones only where some row has the figure."""
    def has(key):
        return any(r.get(key) is not None for r in rows)
    cols = [("dtype", "---", _dtypes), ("batch", "--:", _cell("b", "{}")),
            ("heads q/kv", "--:", lambda r: f"{r['hq']}/{r['hkv']}"), ("d", "--:", _cell("d", "{}")),
            ("cache len", "--:", _cell("L", "{}")), ("seqlen_q", "--:", _cell("sq", "{}")),
            ("cache MB", "--:", _cell("kv_mb")), ("splits", "--:", _cell("num_splits", "{}")),
            ("µs", "--:", lambda r: f"**{r['ours_us']:.1f}**" if r.get("ours_us") else str(r.get("check"))),
            ("TB/s", "--:", _cell("ours_tbs", "{:.2f}")), ("% ceiling", "--:", _cell("ours_pct", "{:.0f}%"))]
    if has("read_us"):
        cols += [("plain read µs", "--:", _cell("read_us")),
                 ("of the read's speed", "--:", _ratio("read_us", "ours_us", "{:.0%}"))]
    if has("same_dtype_us"):
        cols += [("µs, caches in q's dtype", "--:", _cell("same_dtype_us")),
                 ("fp8 / q's dtype", "--:", _ratio("ours_us", "same_dtype_us"))]
    cols += [(f"×{PEER_NAMES[p]}", "---" if p == "flashinfer" else "--:",
              _ratio(f"{p}_us", "ours_us", "{:.2f}", f"{p}_note" if p == "flashinfer" else None))
             for p in peers if has(f"{p}_us")]
    if has("paged16_us") or has("fi_paged16_note"):
        cols += [("shuffled pages of 16 µs", "--:", _cell("paged16_us")),
                 ("×FlashInfer there", "---", _ratio("fi_paged16_us", "paged16_us", "{:.2f}", "fi_paged16_note"))]
    if has("sinks_us"):
        cols += [("with sinks µs", "--:", _cell("sinks_us")),
                 ("sinks / without", "--:", _ratio("sinks_us", "ours_us"))]
    if has("invariant_us") or has("invariant_check"):
        cols += [("batch_invariant µs", "--:", lambda r: f"{r['invariant_us']:.1f}" if r.get("invariant_us")
                  else str(r.get("invariant_check", "–"))),
                 ("invariant / default", "--:", _ratio("invariant_us", "ours_us"))]
    return cols


def serving_columns():
    """The serving matrix's markdown columns: per pool, µs (× the contiguous cache) and
    FlashInfer's time over flash_decode's (its faster variant named)."""
    def pool(key, name):
        def timed(r):
            if r.get(key + "_vs_contiguous"):
                return f"{r[key + '_us']:.1f} ({r[key + '_vs_contiguous']:.3f})"
            return str(r.get(key + "_us") or r.get(key + "_check", "–"))
        return [(f"{name} µs (× contiguous)", "--:", timed),
                (f"×FlashInfer, {name}", "---", _ratio(f"{key}_fi_us", f"{key}_us", "{:.3f}", f"{key}_fi_note"))]
    cols = [("dtype", "---", _dtypes), ("heads q/kv", "--:", lambda r: f"{r['hq']}/{r['hkv']}"),
            ("d", "--:", _cell("d", "{}")), ("batch", "--:", _cell("b", "{}")),
            ("lengths", "--:", lambda r: f"{r['lo']}-{r['hi']}" if r["lo"] != r["hi"] else str(r["hi"])),
            ("MB attended", "--:", _cell("kv_mb")), ("contiguous µs", "--:", _cell("contiguous_us")),
            ("plain read µs", "--:", _cell("contiguous_read_us")),
            ("of the read's speed", "--:", _ratio("contiguous_read_us", "contiguous_us", "{:.0%}"))]
    for page in SERVING_PAGES:
        cols += pool(f"page{page}", f"pages of {page}")
    return cols


def ragged_columns():
    """The --ragged table's markdown columns."""
    return [("dtype", "---", _cell("dtype", "{}")), ("heads q/kv", "--:", lambda r: f"{r['hq']}/{r['hkv']}"),
            ("d", "--:", _cell("d", "{}")), ("batch", "--:", _cell("b", "{}")), ("cache len", "--:", _cell("L", "{}")),
            ("query lengths", "--:", lambda r: f"{r['lo']}-{r['hi']}" if r["lo"] != r["hi"] else str(r["hi"])),
            ("query rows", "--:", _cell("total_q", "{}")), ("cache MB", "--:", _cell("kv_mb")),
            ("ragged µs", "--:", lambda r: f"**{r['ragged_us']:.1f}**" if r.get("ragged_us") else "–"),
            ("TB/s", "--:", _cell("tbs", "{:.2f}")), ("uniform parts µs (sum)", "--:", _cell("parts_us")),
            ("ragged / parts", "--:", _cell("vs_parts", "{:.3f}")), ("padded µs", "--:", _cell("padded_us")),
            ("ragged / padded", "--:", _cell("vs_padded", "{:.3f}")), ("check", "---", _cell("check", "{}"))]


def ragged_summary(rows):
    """[(what, value)]: the ragged call's time over its uniform parts' sum and over the padded
    call's, mixed batches and uniform ones (one part) apart."""
    out = []
    for what, key in (("ragged call over the sum of its uniform parts", "vs_parts"),
                      ("ragged call over the call padded to the longest", "vs_padded")):
        for kind, uniform in (("mixed lengths", False), ("equal lengths", True)):
            ratios = [r[key] for r in rows if r.get(key) and (r["lo"] == r["hi"]) == uniform]
            if ratios:
                out.append((f"{what}, {kind} (time / time)", f"geomean {geomean(ratios):.3f}x, min "
                            f"{min(ratios):.3f}x, max {max(ratios):.3f}x over {_shapes(len(ratios))}"))
    return out


def serving_summary(rows, tie=0.01):
    """[(what, value)]: per page size, FlashInfer's time over flash_decode's (geomean, wins,
    ties within ±tie, losses) and the pool's time over the contiguous cache's."""
    out = []
    for page in SERVING_PAGES:
        key = f"page{page}"
        ratios = [r[key + "_fi_ratio"] for r in rows if r.get(key + "_fi_ratio")]
        if ratios:
            wins, ties = sum(x > 1 + tie for x in ratios), sum(abs(x - 1) <= tie for x in ratios)
            out.append((f"vs FlashInfer's faster variant, pages of {page} (its time / flash_decode's)",
                        f"geomean {geomean(ratios):.3f}x, min {min(ratios):.3f}x; {wins} ahead, {ties} within "
                        f"±{tie:.0%}, {len(ratios) - wins - ties} behind over {_shapes(len(ratios))}"))
        over = [r[key + "_vs_contiguous"] for r in rows if r.get(key + "_vs_contiguous")]
        if over:
            out.append((f"pages of {page} over the contiguous cache of the same lengths",
                        f"median {statistics.median(over):.3f}x, max {max(over):.3f}x over {_shapes(len(over))}"))
    return out


def write_markdown(out_dir, rows, summary, matrix, peers, meta):
    """Print the table (with summary), the serving matrix and the ragged batches (with their
    own) as markdown and write them to table.md, serving.md and ragged.md under out_dir."""
    fi = (f"FlashInfer {meta['flashinfer']}" if meta.get("flashinfer") else
          "FlashInfer: not importable here, so no FlashInfer figures")
    head = f"{meta.get('device')}, torch {meta.get('torch')}, {fi}, {meta.get('date')}"
    for name, data, cols, lines in (("table.md", rows, lambda: table_columns(rows, peers), summary),
                                    ("serving.md", matrix, serving_columns, meta.get("serving_summary", [])),
                                    ("ragged.md", meta.get("ragged"), ragged_columns, meta.get("ragged_summary", []))):
        if not data:
            continue
        text = "\n".join([head, "", markdown(cols(), data), "", *(f"- {w}: {v}" for w, v in lines)])
        print("\n" + text)
        (out_dir / name).write_text(text + "\n")
        print(f"wrote {out_dir / name}")


def _shapes(n):
    return f"{n} shape" + ("s" if n != 1 else "")


def fp8_bounds(rows):
    """[(what, value)]: fp8 rows against the bounds they are held to: their time over the same
    shape's in q's dtype where that cache is 256 MB or more, and their share of the plain
    read's speed (of the fp8 bytes) from 64 MB and from 512 MB of them."""
    out = []
    slower = [r["ours_us"] / r["same_dtype_us"] for r in rows
              if r.get("ours_us") and r.get("same_dtype_us") and 2 * r["kv_mb"] >= 256]
    if slower:
        out.append(("fp8 over q's dtype where that cache is >= 256 MB",
                    f"max {max(slower):.3f}x over {_shapes(len(slower))}"))
    for lo in (64, 512):
        shares = [r["read_us"] / r["ours_us"] for r in rows
                  if r.get("kv_dtype", r["dtype"]) in KV_DTYPES and r.get("read_us") and r.get("ours_us")
                  and r["kv_mb"] >= lo]
        if shares:
            out.append((f"fp8 caches >= {lo} MB: share of the plain read's speed",
                        f"min {min(shares):.1%} over {_shapes(len(shares))}"))
    return out


def csv_columns(peers):
    base = ["dtype", "kv_dtype", *Shape._fields, "kv_mb", "layers", "num_splits", "kernel", "plan_note", "check",
            "ours_us", "ours_tbs", "ours_pct", "ours_timing", "ours_eager_us", "sdpa_eager_us", "sdpa_eager_note",
            "sweep_us", "read_us", "read_tbs", "read_pct", "same_dtype_us", "sinks_us", "sinks_check",
            "invariant_us", "invariant_check",
            "paged16_us", "paged16_check", "fi_paged16_us", "fi_paged16_note"]
    return base + [f"{p}_{k}" for p in peers for k in ("us", "tbs", "ratio", "note")]


def write_results(out_dir, rows, meta, summary, peers):
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "results.json", "w") as f:
        json.dump(dict(meta=meta, rows=rows, summary=[dict(what=what, value=value) for what, value in summary]),
                  f, indent=1)
    with open(out_dir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, csv_columns(peers), restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: _csv_value(v) for k, v in r.items()} for r in rows)


def _csv_value(v):
    """A CSV cell: floats to 4 digits, a sweep {num_splits: us} as 'n:us n:us'."""
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return " ".join(f"{n}:{us:.4g}" for n, us in v.items())
    return v


def plot(rows, ceiling, path, peers):
    """TB/s against cache length, one panel per batch size, peers alongside."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    batches = sorted({r["b"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(3.6 * len(batches), 4), sharey=True, squeeze=False)
    style = dict(cudnn=("C0", "s"), flash=("C1", "^"), efficient=("C2", "v"), flex=("C4", "D"),
                 flashinfer=("C5", "P"))
    series = [("ours", "flash_decode", "C3", "o")] + [(p, p, *style[p]) for p in peers]
    for ax, b in zip(axes[0], batches):
        configs = {}
        for r in rows:
            if r["b"] == b:
                configs.setdefault((r["dtype"], r["hq"], r["hkv"], r["d"], r["sq"]), []).append(r)
        for key, name, color, marker in series:
            for config in configs.values():
                pts = sorted((r["L"], r[f"{key}_tbs"]) for r in config if f"{key}_tbs" in r)
                if pts:
                    ax.plot(*zip(*pts), color=color, marker=marker, ms=4, lw=1, alpha=0.8, label=name)
        ax.axhline(ceiling, color="k", ls="--", lw=1, label=f"read ceiling {ceiling:.2f} TB/s")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1024:g}K")
        ax.set(title=f"batch {b}", xlabel="cache length (tokens)")
    axes[0][0].set_ylabel("TB/s of KV read")
    handles = {}  # one legend entry per series, across panels
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_row(r, peers):
    """One progress line: ours (µs, TB/s, % of ceiling), then each peer's ratio (or µs, or n/a)."""
    text = f"{_dtypes(r)} {label(Shape(*(r[f] for f in Shape._fields)))} {r['kv_mb']:.1f}MB"
    if "ours_us" in r:
        whole = f" after {r['whole_items']} whole" if r.get("whole_items") else ""
        text += (f" x{r['layers']} splits={r.get('num_splits', '?')}{whole} | {r['ours_us']:.1f}us "
                 f"{r['ours_tbs']:.2f}TB/s {r['ours_pct']:.0f}%")
    else:
        text += f" | {r.get('check')}"
    if r.get("sweep_us"):
        text += " | splits " + " ".join(f"{n}:{us:.1f}" for n, us in r["sweep_us"].items())
    if "read_us" in r:
        text += f" | read {r['read_us']:.1f}us {r['read_pct']:.0f}%"
    extras = (("same_dtype_us", f"in {r['dtype']}"), ("sinks_us", "with sinks"), ("invariant_us", "batch_invariant"),
              ("paged16_us", "shuffled pages of 16"), ("fi_paged16_us", "FlashInfer there"))
    text += "".join(f" | {what} {r[key]:.1f}us" for key, what in extras if r.get(key))
    text += "".join(f" | {key} {r[key]}" for key in ("sinks_check", "invariant_check", "paged16_check",
                                                     "fi_paged16_note", "plan_note")
                    if r.get(key) and r[key] != "ok")
    for p in peers:
        if f"{p}_ratio" in r:
            text += f" | {p} {r[p + '_ratio']:.2f}x"
        elif f"{p}_us" in r:
            text += f" | {p} {r[p + '_us']:.1f}us"
        elif f"{p}_note" in r:
            text += f" | {p} {r[p + '_note']}"
    return text


def _progress(items):
    try:
        from tqdm import tqdm
    except ImportError:
        return items, print
    bar = tqdm(items, unit="shape", file=sys.stderr)
    return bar, bar.write


def gpu_missing():
    """Why this machine cannot run the benchmark, in a few words; None if it can."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns when a driver is present but unusable
        if torch.cuda.is_available():
            return None
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    return "torch finds none (torch.cuda.is_available() is False)"


def main(argv=None):
    args = parse_args(argv)
    why = gpu_missing()
    if why:  # one line, no traceback: this is the usual outcome on a laptop or in CI
        print(f"flash-decode-bench needs an NVIDIA GPU: {why}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    ceilings = read_ceiling(args.repeats)
    args.ceiling = max(ceilings.values())
    settle(args.settle)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, flash_decode=flash_decode.__version__,
                layout=args.layout, causal=False, cache_seqlens=None, peers=args.peers, repeats=args.repeats,
                flashinfer=getattr(import_flashinfer(), "__version__", None),
                ceiling_tbs=args.ceiling, ceilings=ceilings, bytes="K+V only", date=time.strftime("%Y-%m-%d %H:%M"))
    print(f"flash_decode bench on {meta['device']}, torch {meta['torch']}, layout {args.layout}, "
          f"{len(args.cases)} cases; non-causal, full caches, TB/s of K+V read; read ceiling "
          + ", ".join(f"{k} {v:.2f}" for k, v in ceilings.items()) + " TB/s", flush=True)
    rows = []
    items, log = _progress(args.cases)
    for i, (shape, dtype) in enumerate(items, 1):
        try:
            row = run_case(shape, dtype, args.peers, args)
            if args.paged16:  # after the case's own layers are gone
                settle(args.settle)
                row.update(paged16_columns(shape, dtype, args.kv_dtype, args.peers, args))
        except Exception as err:  # noqa: BLE001 (report the case, go on with the others)
            row = dict(dtype=dtype, kv_dtype=args.kv_dtype or dtype, **shape._asdict(),
                       kv_mb=round(kv_bytes(shape, dtype, args.kv_dtype) / MB, 2),
                       check=f"n/a ({type(err).__name__}: {_reason(err)})")
        rows.append(row)
        settle(args.settle)
        log(f"[{i}/{len(args.cases)}] " + format_row(row, args.peers))
    serving = run_serving(args, log) if args.serving_shapes else []
    matrix = run_serving_matrix(args, log) if args.serving_cases else []
    lengths = run_lengths(args, log) if args.lengths else []
    ragged = run_ragged(args, log) if args.ragged_cases else []
    try:
        meta["eager"] = eager_tiny()  # reported in the summary
    except Exception as err:  # noqa: BLE001
        meta["eager"] = None
        print(f"eager call: n/a ({type(err).__name__}: {_reason(err)})")
    summary = summarize(rows, meta["eager"])
    for what, value in summary:
        print(f"{what}: {value}")
    meta.update(serving=serving, lengths=lengths, kv_dtype=args.kv_dtype, descale_range=DESCALE_RANGE,
                serving_matrix=matrix, serving_summary=serving_summary(matrix), seed=args.seed, ragged=ragged,
                ragged_summary=ragged_summary(ragged))
    write_results(args.out, rows, meta, summary, args.peers)
    print(f"wrote {args.out}/results.json and results.csv")
    write_markdown(args.out, rows, summary, matrix, args.peers, meta)
    if not args.no_plot and rows:  # a run of serving or --lengths cases alone has no table to plot
        try:
            plot(rows, args.ceiling, args.out / "bandwidth.png", args.peers)
            print(f"wrote {args.out}/bandwidth.png")
        except ImportError:
            print("matplotlib is not installed: no plot (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
