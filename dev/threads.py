"""Per-call time of eager calls from 1, 2, 4 and 8 Python threads.

    python3 dev/threads.py [--calls 4000] [--runs 5] [--switch-interval S] [--cpus N]

Rows: flash_decode (the soak test's layout: b=2, 32/8 heads, d128, a
cache_seqlens tensor, out given) over 4096 tokens (a call's GPU time is about
its host time) and over 512 (the host path alone), each thread on its own
stream; 512 with every thread on the default stream; 512 from one thread
whose calls take the column's count of streams in turn (what many streams
cost without threads); the bare Go call under it (the binding's Workspace:
into Go and back, releasing and retaking the GIL, launching nothing); a torch
op (an in-place add on a small tensor, which releases the GIL around its
launch). Each figure is the aggregate wall time over all threads' calls
divided by the number of calls, the best of --runs rounds that each run every
column once: below the one-thread figure means threads help, above means they
contend. Needs a CUDA GPU.
"""

import argparse
import os
import sys
import threading
import time

import torch

import flash_decode
from flash_decode import _api

B, HQ, HKV, D, N = 2, 32, 8, 128, 4096


def flash_case(n):
    def make():
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.float16)
        k = torch.randn(B, n, HKV, D, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)

        def call():
            flash_decode.flash_decode(q, k, v, cache_seqlens=lens, out=out)
        return call
    return make


def go_case():
    q = torch.empty(B, 1, HQ, D, dtype=torch.float16, device="meta")  # shapes and strides only
    kv = torch.empty(B, N, HKV, D, dtype=torch.float16, device="meta")
    native, record = _api._call(q, kv, kv)
    handle = _api._prepare_on(native, record, torch.cuda.current_device())
    workspace = native.Workspace

    def call():
        workspace(handle, -1)
    return call


def torch_case():
    x = torch.zeros(64, device="cuda")

    def call():
        x.add_(1.0)
    return call


def threaded(make, threads, calls, own_streams):
    """A run of calls calls from each of threads threads; returns its
    aggregate microseconds per call."""
    fns = [make() for _ in range(threads)]
    streams = [torch.cuda.Stream() if own_streams else torch.cuda.default_stream() for _ in range(threads)]

    def loop(fn, stream):
        with torch.cuda.stream(stream):
            for _ in range(calls):
                fn()

    def run():
        workers = [threading.Thread(target=loop, args=(fn, s)) for fn, s in zip(fns, streams)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / (threads * calls) * 1e6
    return run


def streams_in_turn(make, streams, calls):
    """A run of one thread whose calls go to `streams` streams in turn;
    returns its microseconds per call."""
    fn = make()
    pool = [torch.cuda.Stream() for _ in range(streams)]

    def run():
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(calls * streams):
            torch.cuda.set_stream(pool[i % streams])  # cheaper than a `with` per call
            fn()
        torch.cuda.set_stream(torch.cuda.default_stream())
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / (streams * calls) * 1e6
    return run


def best_of(runs, setups):
    """Each setup's best time over runs rounds; a round runs every setup
    once, so a drift of the host's speed reaches all columns alike."""
    best = [float("inf")] * len(setups)
    for _ in range(runs):
        for i, run in enumerate(setups):
            best[i] = min(best[i], run())
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=4000, help="calls per thread per run")
    ap.add_argument("--runs", type=int, default=5, help="rounds; each figure is the best of them")
    ap.add_argument("--switch-interval", type=float, metavar="S",
                    help="sys.setswitchinterval(S): how long a thread may hold the GIL while others wait")
    ap.add_argument("--cpus", type=int, metavar="N", help="run every thread on the first N CPUs only")
    args = ap.parse_args()
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    if args.cpus:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cpus])
    counts = (1, 2, 4, 8)
    print(f"{'us per call, aggregate':28}" + "".join(f"{n:>4} thr" for n in counts))
    for name, make, own_streams in (("flash_decode, 4096 tokens", flash_case(4096), True),
                                    ("flash_decode, 512 tokens", flash_case(512), True),
                                    ("  the same, one stream", flash_case(512), False),
                                    ("Go call (Workspace)", go_case, True),
                                    ("torch x.add_(1)", torch_case, True)):
        make()()  # warm-up: layout cache, module load
        row = best_of(args.runs, [threaded(make, n, args.calls, own_streams) for n in counts])
        print(f"{name:28}" + "".join(f"{us:8.1f}" for us in row), flush=True)
        if name.startswith("  the same, one stream"):
            row = best_of(args.runs, [streams_in_turn(flash_case(512), n, args.calls) for n in counts])
            print(f"{'  one thread, N streams':28}" + "".join(f"{us:8.1f}" for us in row), flush=True)

if __name__ == "__main__":
    main()
