"""Calls every kernel path of flash_decode once, for compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \\
        --kernel-name regex=^fd_ python3 dev/sanitize.py

(and --tool racecheck, synccheck; initcheck without --kernel-name, since it
counts memory as written only by the kernels it instruments, and torch's
kernels write the inputs). Without torch's caching
allocator every tensor is its own allocation, so memcheck sees a read past
one. The paths: split + combine (4 warps a row, a block a row's 32 columns, and a warp a row), the cluster merge,
whole_items with a split tail, splits balanced by the lengths (plain and
paged), head dims 64/96/128/256, seqlen_q 10 causal
(its 16-row blocks, like 4 query tokens at 32/8 heads, merge their key warps
once a row, in a cluster too),
ragged lengths with zeros, odd GQA ratios, int and absent cache_seqlens, the
paged cache (pages of 1 through the serving kernel; of 8 and 16 through its
paged form, in clusters and with the combine) with and without append and
rotary, the appending forms (paged and contiguous, and the append kernel
past 16 new tokens), cache_batch_idx, cache_leftpad with a window, softcap, ALiBi, and
merge_states.

--dry-run builds every call's arguments on the meta device (no GPU, no
memory) and prints the plan of each from flash_decode.plan(..., device=-1),
for an H200, told the serving arguments that change the plan or the kernel
(serving, seqlen_new, rotary, window_size, page_size).

--only REGEX runs only the paths whose names match it, e.g. --only 'paged|merge'
for racecheck, which takes minutes over all of them.
"""

import argparse
import re
import sys

import torch

import flash_decode

F16, BF16 = torch.float16, torch.bfloat16


def cases():
    """(name, plain plan's shape, call, expected plan traits) per path: call(dev)
    returns flash_decode's keyword arguments built on device dev."""

    def rand(dev, *shape, dtype=F16):
        return torch.randn(*shape, device=dev, dtype=torch.float32).to(dtype)

    def ints(dev, values):
        return torch.tensor(values, dtype=torch.int32, device=dev)

    def plain(b, sq, hq, hkv, d, n, dtype=F16, **extra):
        def call(dev):
            kw = dict(q=rand(dev, b, sq, hq, d, dtype=dtype), k_cache=rand(dev, b, n, hkv, d, dtype=dtype),
                      v_cache=rand(dev, b, n, hkv, d, dtype=dtype), return_softmax_lse=True)
            for key, value in extra.items():
                kw[key] = value(dev) if callable(value) else value
            return kw
        seqlen = extra.get("cache_seqlens")
        return (b, sq, hq, hkv, d, n, dtype, extra.get("num_splits", 0), seqlen if type(seqlen) is int else None), call

    def paged(page, b=2, sq=2, hq=32, hkv=8, d=128, n=4096, interleaved=False, append=True, rotary=True, new=2):
        pages = b * n // page

        def call(dev):
            table = torch.randperm(pages, device=dev).to(torch.int32).view(b, n // page)
            kw = dict(q=rand(dev, b, sq, hq, d), k_cache=rand(dev, pages, page, hkv, d),
                      v_cache=rand(dev, pages, page, hkv, d), block_table=table,
                      cache_seqlens=ints(dev, [n - 2, 17][:b]), causal=True, return_softmax_lse=True)
            if append:
                kw.update(k=rand(dev, b, new, hkv, d), v=rand(dev, b, new, hkv, d))
            if append and rotary:
                half = 32  # rotary_dim 64
                kw.update(rotary_cos=rand(dev, n, half), rotary_sin=rand(dev, n, half), rotary_interleaved=interleaved)
            return kw
        return (b, sq, hq, hkv, d, n, F16, 0, None), call

    lens = lambda *v: lambda dev: ints(dev, list(v))  # noqa: E731
    new = lambda b, t, hkv, d: lambda dev: rand(dev, b, t, hkv, d)  # noqa: E731
    table = lambda n, half: lambda dev: rand(dev, n, half)  # noqa: E731
    return [
        ("split + combine (4 warps)", *plain(1, 1, 32, 8, 128, 32768), dict(combine="fd_combine_f16")),
        ("split + narrow combine (a warp a row)", *plain(32, 1, 8, 1, 128, 16384), dict(combine="fd_combine_f16_r4")),
        ("split + narrow combine, 16 rows a block", *plain(1, 10, 48, 48, 128, 8192, causal=True),
         dict(combine="fd_combine_f16_r16")),
        ("split + combine (column groups)", *plain(1, 1, 32, 8, 128, 32768, num_splits=64),
         dict(combine="fd_combine_f16_c32")),
        ("cluster merge", *plain(2, 1, 32, 8, 128, 4096, cache_seqlens=lens(4096, 1234)), dict(cluster=True)),
        ("cluster merge, keys prefetched into L2", *plain(1, 1, 32, 8, 128, 1024, cache_seqlens=lens(700)),
         dict(cluster=True, prefetch=True)),
        ("cluster merge of one-tile splits, d256", *plain(1, 1, 32, 8, 256, 256, cache_seqlens=lens(201)),
         dict(cluster=True, prefetch=True)),
        ("cluster merge of one-tile splits, 32 rows", *plain(1, 8, 32, 4, 128, 512, causal=True), dict(cluster=True)),
        ("cluster merge, 16 rows merged by row", *plain(1, 4, 32, 8, 128, 1024, causal=True), dict(cluster=True)),
        ("whole_items, split tail", *plain(40, 1, 32, 8, 128, 8192), dict(whole_items=True)),
        ("d64, split + combine", *plain(1, 1, 8, 8, 64, 262144), dict(combine="fd_combine_f16")),
        ("d64, cluster", *plain(3, 1, 8, 8, 64, 2048), dict(cluster=True)),
        ("d96 (padded to 128), MHA", *plain(2, 1, 12, 12, 96, 1500), {}),
        ("d256 bf16, split + combine", *plain(2, 1, 16, 2, 256, 8192, BF16), dict(combine="fd_combine_bf16")),
        ("seqlen_q 10 causal, lengths below seqlen_q",
         *plain(2, 10, 8, 2, 128, 3000, causal=True, cache_seqlens=lens(3000, 7)), {}),
        ("ragged lengths with zeros", *plain(4, 1, 32, 8, 128, 4096, cache_seqlens=lens(0, 4096, 1, 2500)), {}),
        ("splits balanced by the lengths", *plain(8, 1, 32, 8, 128, 32768,
                                                  cache_seqlens=lens(32768, 1024, 0, 1, 4000, 1024, 64, 65)),
         dict(balanced=True)),
        ("splits balanced by the lengths from one split", *plain(24, 1, 32, 8, 128, 8192,
                                                                 cache_seqlens=lens(8192, *[512] * 22, 0)),
         dict(balanced=True)),
        ("splits balanced by the lengths, paged, 4 query tokens",
         *paged(16, b=2, sq=4, n=16384, append=False), dict(balanced=True, kernel="fd_split_kv_paged_")),
        ("GQA 7 (28/4)", *plain(3, 1, 28, 4, 128, 5000, cache_seqlens=lens(5000, 0, 4999)), {}),
        ("MQA 7/1", *plain(2, 1, 7, 1, 128, 700), {}),
        ("int cache_seqlens", *plain(2, 1, 32, 8, 128, 4096, cache_seqlens=1000), {}),
        ("paged, page 16, append + rotary", *paged(16), dict(kernel="fd_split_kv_paged_f16")),
        ("paged, page 16, 17 new tokens (append kernel)", *paged(16, new=17, rotary=False),
         dict(kernel="fd_split_kv_paged_f16")),
        ("paged, page 16, append fused into stage 1", *paged(16, rotary=False),
         dict(kernel="fd_split_kv_paged_", fused_append=True)),
        ("paged, page 16, cluster merge", *paged(16, b=1, sq=1, n=1024, append=False),
         dict(kernel="fd_split_kv_paged_", cluster=True)),
        ("paged, page 8, d64", *paged(8, b=1, sq=1, hq=8, hkv=8, d=64, n=16384, append=False),
         dict(kernel="fd_split_kv_paged_")),
        ("paged, page 1, append + interleaved rotary", *paged(1, n=1024, interleaved=True),
         dict(kernel="fd_split_kv_serving_")),
        ("contiguous, append fused into stage 1",
         *plain(2, 2, 32, 8, 128, 4096, causal=True, cache_seqlens=lens(4094, 17), k=new(2, 2, 8, 128),
                v=new(2, 2, 8, 128)), dict(kernel="fd_split_kv_append_f16", fused_append=True)),
        ("contiguous, append + interleaved rotary",
         *plain(2, 2, 32, 8, 128, 4096, causal=True, cache_seqlens=lens(4094, 17), k=new(2, 2, 8, 128),
                v=new(2, 2, 8, 128), rotary_cos=table(4096, 32), rotary_sin=table(4096, 32), rotary_interleaved=True),
         dict(kernel="fd_split_kv_serving_")),
        ("contiguous, d64, append fused into stage 1, cluster merge",
         *plain(1, 1, 8, 8, 64, 2048, cache_seqlens=lens(2000), k=new(1, 1, 8, 64), v=new(1, 1, 8, 64)),
         dict(kernel="fd_split_kv_append_f16", fused_append=True, cluster=True)),
        ("cache_batch_idx", *plain(2, 1, 32, 8, 128, 2048, cache_seqlens=lens(2048, 5),
                                   cache_batch_idx=lens(1, 0)), {}),
        ("cache_leftpad + window", *plain(2, 1, 32, 8, 128, 2048, cache_seqlens=lens(2048, 900),
                                          cache_leftpad=lens(100, 0), window_size=(256, 0)), {}),
        ("softcap", *plain(2, 1, 32, 8, 128, 4096, softcap=30.0), {}),
        ("serving whole_items, split tail (softcap)", *plain(40, 1, 32, 8, 128, 8192, softcap=50.0),
         dict(whole_items=True)),
        ("ALiBi per head", *plain(2, 1, 32, 8, 128, 4096, cache_seqlens=lens(4096, 3000),
                                  alibi_slopes=lambda dev: torch.rand(32, device=dev)), {}),
        ("ALiBi per sequence and head, causal, seqlen_q 4",
         *plain(2, 4, 32, 8, 128, 4096, causal=True, alibi_slopes=lambda dev: torch.rand(2, 32, device=dev)), {}),
    ]


def merge_cases():
    """(name, call) per merge_states path: call(dev) returns its arguments."""

    def states(dev, n, rows, d, dtype, empty_row=True):
        outs = [torch.randn(*rows, d, device=dev).to(dtype) for _ in range(n)]
        lses = [torch.randn(*rows, device=dev) for _ in range(n)]
        if empty_row:
            for lse in lses:
                lse.view(-1)[0] = float("-inf")  # a row whose states are all empty
        return outs, lses

    def stacked(dev):
        outs, lses = states(dev, 3, (2, 32), 128, torch.float32)
        return torch.stack(outs), torch.stack(lses)

    def transposed(dev):
        outs, lses = states(dev, 2, (8, 4), 4, F16)
        return [o.transpose(0, 1) for o in outs], [lse.transpose(0, 1).contiguous() for lse in lses]

    return [
        ("merge_states, 3 fp16 states as a list", lambda dev: states(dev, 3, (4, 32), 128, F16)),
        ("merge_states, 9 bf16 states (stacked copy)", lambda dev: states(dev, 9, (2, 8), 64, BF16)),
        ("merge_states, fp32 stacked tensor", stacked),
        ("merge_states, d4, outputs with transposed rows", transposed),
    ]


def describe(p):
    return (f"{p['kernel']}, {p['num_splits']} splits, grid {p['grid']}, cluster {p['cluster']}, "
            f"combine {p['combine'] or '-'}, whole_items {p['whole_items']}, prefetch_tiles {p.get('prefetch_tiles', 0)}, "
            f"balance_splits {p.get('balance_splits', 0)}, "
            f"workspace {p['workspace_bytes']} B")


def check_traits(name, p, want):
    """Fails where a case no longer reaches the path it is named for."""
    ok = (("kernel" not in want or p["kernel"].startswith(want["kernel"]))
          and ("fused_append" not in want or p.get("fused_append", False))
          and ("combine" not in want or p["combine"] == want["combine"])
          and ("cluster" not in want or p["cluster"] > 1)
          and ("whole_items" not in want or p["whole_items"] > 0)
          and ("prefetch" not in want or p.get("prefetch_tiles", 0) > 0)
          and ("balanced" not in want or p.get("balance_splits", 0) > 0))
    if not ok:
        sys.exit(f"{name}: the plan {describe(p)} misses the path {want}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="build the arguments on the meta device and print the plans; no GPU")
    ap.add_argument("--only", metavar="REGEX", type=re.compile,
                    help="only the paths whose names match (racecheck over every path takes minutes)")
    args = ap.parse_args()
    wanted = (lambda name: True) if args.only is None else (lambda name: args.only.search(name) is not None)
    dev = "meta" if args.dry_run else "cuda"
    torch.manual_seed(0)
    for name, (b, sq, hq, hkv, d, n, dtype, splits, seqlen), call, want in cases():
        if not wanted(name):
            continue
        kw = call(dev)
        serving = any(kw.get(key) is not None for key in ("k", "block_table", "cache_batch_idx", "cache_leftpad",
                                                           "alibi_slopes")) or "window_size" in kw or "softcap" in kw
        # What plan() is told of a serving call: the arguments that change the plan or the kernel.
        extra = dict(serving=True, seqlen_new=kw["k"].shape[1] if kw.get("k") is not None else 0,
                     rotary=kw.get("rotary_cos") is not None, window_size=kw.get("window_size", (-1, -1)),
                     page_size=kw["k_cache"].shape[1] if kw.get("block_table") is not None else 0) if serving else {}
        tensor_lengths = isinstance(kw.get("cache_seqlens"), torch.Tensor) and kw.get("cache_leftpad") is None
        p = flash_decode.plan(b, sq, hq, hkv, d, n, dtype=dtype, num_splits=splits, seqlen=seqlen, device=-1,
                              lengths=tensor_lengths, **extra)
        check_traits(name, p, want)
        print(f"{name}: {describe(p)}", flush=True)
        if args.dry_run:
            continue
        out, lse = flash_decode.flash_decode(**kw)
        torch.cuda.synchronize()
        if not torch.isfinite(out).all():
            sys.exit(f"{name}: non-finite output")
    for name, call in merge_cases():
        if not wanted(name):
            continue
        outs, lses = call(dev)
        print(name, flush=True)
        if args.dry_run:
            continue
        flash_decode.merge_states(outs, lses)
        torch.cuda.synchronize()
    if wanted("merge_state"):
        lses = [torch.randn(4, 32, device=dev) for _ in range(2)]
        outs = [torch.randn(4, 32, 128, device=dev).half() for _ in range(2)]
        print("merge_state", flush=True)
        if not args.dry_run:
            flash_decode.merge_state(outs[0], lses[0], outs[1], lses[1])
            torch.cuda.synchronize()
    print("done", flush=True)


if __name__ == "__main__":
    main()
