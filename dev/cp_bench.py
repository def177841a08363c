"""Context-parallel decode over 1-8 GPUs: the time of flash_decode.distributed.decode per layer's call
(each rank's flash_decode over its shard, the all-gather of the (out, lse) states, the merge), the
parts of it (the shard's call alone, the all-gather alone: the collective's share), the bytes each GPU
reads per second, and the single-GPU flash_decode over the same whole cache where it fits on rank 0.
Needs CUDA GPUs; one process per GPU under torchrun, or one process alone (a world of 1):

    torchrun --nproc-per-node 8 dev/cp_bench.py                                # the default cases
    for n in 1 2 4 8; do torchrun --nproc-per-node $n dev/cp_bench.py --out /tmp/cp; done   # scaling
    torchrun --nproc-per-node 8 dev/cp_bench.py --lengths 1m --layers 80 --no-single     # 320 GB of cache
    torchrun --nproc-per-node 4 dev/cp_bench.py --batch 1,8 --append   # each call appends its step's token
    python3 dev/cp_bench.py --lengths 32k --layout pages16                     # one GPU, no torchrun

Each case holds --layers layers of cache (a step's calls read them in turn, past the L2) of --batch
sequences of the global length, sharded by --layout; times are medians over --repeats steps of the
slowest rank, per layer. Rank 0 prints a markdown row per case and, with --out, appends the rows to
cp_results.jsonl there (runs at several world sizes accumulate; efficiency is single / (world x step)).
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

import flash_decode
from flash_decode import distributed as fdist

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
COLUMNS = ("world", "layout", "batch", "heads", "headdim", "length", "layers", "dtype", "append", "step_us",
           "attend_us", "gather_us", "collective_share", "read_gbps_per_gpu", "single_us", "efficiency")


def parse_count(text):
    """An int with an optional k (x1024) or m (x1024^2) suffix: "128k", "1m"."""
    text = text.strip().lower()
    scale = {"k": 1024, "m": 1024 ** 2}.get(text[-1:], 1)
    value = int(text[:-1] if scale > 1 else text)
    if value < 1:
        raise ValueError(f"{text!r} must be at least 1")
    return value * scale


def counts(text):
    try:
        return [parse_count(x) for x in text.split(",")]
    except (ValueError, IndexError) as err:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated counts like 32k,1m ({err})")


def heads(text):
    try:
        q, kv = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: heads as nheads_q/nheads_kv, e.g. 32/8")
    if kv < 1 or q < kv or q % kv:
        raise argparse.ArgumentTypeError(f"{text!r}: nheads_q must be a positive multiple of nheads_kv")
    return q, kv


def layout(text):
    if text in ("contiguous", "interleaved"):
        return text, 0
    if text.startswith("pages") and text[5:].isdigit() and int(text[5:]) > 0:
        return "pages", int(text[5:])
    raise argparse.ArgumentTypeError(f"{text!r}: contiguous, interleaved or pagesN (pages of N keys, e.g. pages16)")


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", type=counts, default=counts("32k,128k,1m"), help="global keys a sequence")
    p.add_argument("--batch", type=counts, default=[1], help="sequences, e.g. 1,8")
    p.add_argument("--heads", type=heads, default=(32, 8), help="nheads_q/nheads_kv (default 32/8)")
    p.add_argument("--headdim", type=positive, default=128)
    p.add_argument("--layout", type=layout, default=("interleaved", 0),
                   help="contiguous, interleaved (default) or pagesN")
    p.add_argument("--layers", type=positive, default=4, help="layers of cache a step reads in turn")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    p.add_argument("--repeats", type=positive, default=20)
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--append", action="store_true",
                   help="each call brings the step's new token (k, v): attended, then written into its rank")
    p.add_argument("--no-single", action="store_true", help="skip the single-GPU call on the whole cache")
    p.add_argument("--out", type=pathlib.Path, help="append the rows to OUT/cp_results.jsonl")
    return p.parse_args(argv)


def shards_for(args, world, length):
    kind, page = args.layout
    if kind == "contiguous":
        return fdist.Shards.contiguous(world, -(-length // world))
    return fdist.Shards.interleaved(world) if kind == "interleaved" else fdist.Shards.pages(world, page)


def make_layers(args, batch, keys, page, dtype):
    """--layers of (q, k_cache, v_cache, block_table or None) with keys a sequence, paged where page > 0."""
    hq, hkv = args.heads
    layers = []
    for _ in range(args.layers):
        q = torch.randn(batch, 1, hq, args.headdim, dtype=dtype, device="cuda")
        if page:
            blocks = -(-keys // page)
            shape, table = (batch * blocks, page, hkv, args.headdim), torch.randperm(
                batch * blocks, dtype=torch.int32, device="cuda").view(batch, blocks)
        else:
            shape, table = (batch, keys, hkv, args.headdim), None
        k, v = (torch.empty(shape, dtype=dtype, device="cuda").normal_() for _ in "kv")
        layers.append((q, k, v, table))
    return layers


def median_us(step, repeats, world):
    """The median over repeats of step()'s GPU time in µs, the slowest rank's (MAX over ranks)."""
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    worst = torch.tensor([statistics.median(times)], device="cuda")
    if world > 1:
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def fits(nbytes):
    return nbytes <= 0.9 * torch.cuda.mem_get_info()[0]


def run_case(args, rank, world, batch, length):
    dtype, (hq, hkv), d = DTYPES[args.dtype], args.heads, args.headdim
    shards = shards_for(args, world, length)
    local = shards.local_length(length, rank)
    row = -(-batch * hq * (d * dtype.itemsize + 4) // 16) * 16  # one rank's (out, lse), packed as decode does
    case = dict(world=world, layout=f"{args.layout[0]}{args.layout[1] or ''}", batch=batch, heads=f"{hq}/{hkv}",
                headdim=d, length=length, layers=args.layers, dtype=args.dtype, append=args.append)
    cache_bytes = 2 * batch * local * hkv * d * dtype.itemsize * args.layers
    ok = torch.tensor([1 if fits(cache_bytes) else 0], device="cuda")
    if world > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok):
        return dict(case, step_us=None, note=f"a rank's {cache_bytes / 2**30:.1f} GiB of shard does not fit")
    layers = make_layers(args, batch, local, args.layout[1], dtype)
    new = [torch.randn(batch, 1, hkv, d, dtype=dtype, device="cuda") for _ in "kv"] if args.append else [None] * 2
    lens = torch.full((batch,), length - args.append, dtype=torch.int32, device="cuda")  # before the new token
    call = dict(shards=shards, cache_seqlens=lens, causal=True)
    step = median_us(lambda: [fdist.decode(q, k, v, *new, block_table=t, **call) for q, k, v, t in layers],
                     args.repeats, world)
    attend = median_us(lambda: [fdist.local_state(q, k, v, rank=rank, block_table=t, **call)
                                for q, k, v, t in layers], args.repeats, world)
    send = torch.zeros(row, dtype=torch.uint8, device="cuda")
    recv = torch.empty(world * row, dtype=torch.uint8, device="cuda")
    gather = median_us(lambda: [dist.all_gather_into_tensor(recv, send) for _ in layers], args.repeats, world)
    del layers
    torch.cuda.empty_cache()
    per = 1.0 / args.layers
    result = dict(case, step_us=step * per, attend_us=attend * per, gather_us=gather * per,
                  collective_share=gather / step, read_gbps_per_gpu=cache_bytes / (attend * 1e-6) / 1e9,
                  single_us=None, efficiency=None)
    if not args.no_single:
        result.update(single(args, rank, world, batch, length, dtype, result["step_us"]))
    return result


def single(args, rank, world, batch, length, dtype, step_us):
    """Rank 0's flash_decode over the whole cache of every layer, where it fits; the others wait."""
    whole = 2 * batch * length * args.heads[1] * args.headdim * dtype.itemsize * args.layers
    us = None
    if rank == 0 and fits(whole):
        layers = make_layers(args, batch, length, 0, dtype)
        lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        us = median_us(lambda: [flash_decode.flash_decode(q, k, v, cache_seqlens=lens, causal=True)
                                for q, k, v, _ in layers], args.repeats, 1) / args.layers
        del layers
        torch.cuda.empty_cache()
    if world > 1:
        dist.barrier()
    return dict(single_us=us, efficiency=None if us is None else us / (world * step_us))


def row_text(result):
    cells = []
    for name in COLUMNS:
        value = result.get(name)
        cells.append("n/a" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value))
    return "| " + " | ".join(cells) + " |" + (f" {result['note']}" if "note" in result else "")


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("cp_bench: needs CUDA GPUs (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    launched = "RANK" in os.environ
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    with tempfile.TemporaryDirectory() as tmp:
        if launched:
            dist.init_process_group(args.backend)
        else:
            dist.init_process_group(args.backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        rank, world = dist.get_rank(), dist.get_world_size()
        try:
            if rank == 0:
                print("| " + " | ".join(COLUMNS) + " |\n|" + " --- |" * len(COLUMNS), flush=True)
            for batch in args.batch:
                for length in args.lengths:
                    result = run_case(args, rank, world, batch, length)
                    if rank == 0:
                        print(row_text(result), flush=True)
                        if args.out:
                            args.out.mkdir(parents=True, exist_ok=True)
                            with open(args.out / "cp_results.jsonl", "a") as f:
                                f.write(json.dumps(result) + "\n")
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
