"""Kernel time of flash_decode with batch_invariant=False and True, side by side, on the bench's
default shapes (fp16, the whole cache, a cache_seqlens tensor of full lengths) and its serving
shapes on paged caches (pages of 16): per case the median over REPEATS replays of a CUDA graph
of one call per layer (layers rotated past the L2, as the bench does), then the ratio, and at the
end the geometric mean and the worst ratio over caches of 64 MB and more. Needs a GPU:

    python3 dev/invariant_ab.py            # about a minute on an H100
"""
import math
import statistics

import torch

import flash_decode

REPEATS, ROTATE_BYTES = 20, 240e6
SHAPES = [  # (b, hq, hkv, d, L, sq, page size)
    *[(1, 32, 8, 128, L, 1, 0) for L in (1024, 4096, 32768, 131072)],
    *[(8, 32, 8, 128, L, 1, 0) for L in (1024, 8192, 65536)],
    (32, 32, 8, 128, 1024, 1, 0), (32, 32, 8, 128, 16384, 1, 0), (128, 32, 8, 128, 1024, 1, 0),
    (128, 32, 8, 128, 8192, 1, 0), (256, 32, 8, 128, 2048, 1, 0),
    (1, 32, 32, 128, 32768, 1, 0), (16, 32, 32, 128, 4096, 1, 0), (1, 64, 8, 128, 32768, 1, 0),
    (8, 64, 8, 128, 8192, 1, 0), (1, 48, 48, 128, 8192, 10, 0), (8, 48, 48, 128, 4096, 10, 0),
    (1, 8, 1, 128, 131072, 1, 0), (32, 8, 1, 128, 16384, 1, 0), (8, 32, 8, 64, 32768, 1, 0),
    (1, 32, 8, 256, 32768, 1, 0), (16, 32, 8, 256, 2048, 1, 0), (1, 32, 8, 128, 32768, 4, 0),
    (16, 32, 8, 128, 8192, 4, 0),
    (1, 32, 8, 128, 32768, 1, 16), (8, 32, 8, 128, 4096, 1, 16), (8, 32, 8, 128, 32768, 1, 16),
    (32, 32, 8, 128, 8192, 1, 16),
]


def layers_of(b, hq, hkv, d, L, sq, page):
    """One call per layer: q, caches and, paged, a shuffled block table, each layer its own."""
    cache_bytes = 2 * b * L * hkv * d * 2
    n = max(3, math.ceil(ROTATE_BYTES / cache_bytes))
    n = min(n, max(1, int(0.4 * torch.cuda.mem_get_info()[0] / cache_bytes)))
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    out = []
    for _ in range(n):
        q = torch.randn(b, sq, hq, d, dtype=torch.float16, device="cuda")
        if page:
            k = torch.randn(b * L // page, page, hkv, d, dtype=torch.float16, device="cuda")
            table = torch.randperm(b * L // page, dtype=torch.int32, device="cuda").view(b, L // page)
        else:
            k, table = torch.randn(b, L, hkv, d, dtype=torch.float16, device="cuda"), None
        out.append((q, k, torch.randn_like(k), table))
    return lens, out, cache_bytes


def time_us(lens, layers, invariant):
    call = lambda: [flash_decode.flash_decode(q, k, v, cache_seqlens=lens, block_table=t, causal=True,
                                              batch_invariant=invariant) for q, k, v, t in layers]
    call()  # plans and module loads before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(layers))
    return statistics.median(times)


big = []
print(f"{'shape':<44} {'MB':>8} {'off us':>9} {'on us':>9} {'on/off':>7}  plan (on)")
for shape in SHAPES:
    lens, layers, cache_bytes = layers_of(*shape)
    off, on = time_us(lens, layers, False), time_us(lens, layers, True)
    b, hq, hkv, d, L, sq, page = shape
    p = flash_decode.plan(b, sq, hq, hkv, d, L, seqlen=L, lengths=True, serving=bool(page), page_size=page,
                          batch_invariant=True)
    name = f"b={b},hq={hq},hkv={hkv},d={d},L={L},sq={sq}" + (f",paged{page}" if page else "")
    print(f"{name:<44} {cache_bytes / 1e6:8.1f} {off:9.2f} {on:9.2f} {on / off:7.3f}  "
          f"{p['num_splits']} splits of {p['invariant_tiles']} tiles, {p['merge']}")
    if cache_bytes >= 64e6:
        big.append(on / off)
    del layers
    torch.cuda.empty_cache()
print(f"caches >= 64 MB: geometric mean {math.exp(statistics.fmean(map(math.log, big))):.3f}, "
      f"worst {max(big):.3f} ({len(big)} cases)")
