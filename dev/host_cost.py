"""Host time of eager flash_decode calls, without a GPU: the project's own part.

    LD_LIBRARY_PATH=_build/ci/fakedevice python3 dev/host_cost.py [--calls 20000] [--rounds 7] [CASE ...]

Runs on make_libcuda.py's fake-device driver (`--fake-device`: one sm_90
device whose launches cost nothing), with CPU tensors standing in for CUDA
ones: the device check and the stream getter are replaced, the rest is the
real call (the layout key, the Go core's checks, plan and launch path
through the gopy extension). Prints, per case, the median and the fastest of
--rounds rounds of --calls calls, in microseconds, and the binding's Run
alone. What it leaves out is torch's CUDA allocator and the driver's launch
(2.5-3.4 us each on an H200 host): BENCHMARKS.md's eager figure has those.
"""

import argparse
import itertools
import statistics
import time

import torch

import flash_decode  # noqa: F401  (the package under test, installed)
from flash_decode import _api, _native


def cases():
    """name -> a call, each with its own tensors."""
    f16 = torch.float16
    q = torch.randn(1, 1, 32, 128, dtype=f16)
    k, v = torch.randn(1, 256, 8, 128, dtype=f16), torch.randn(1, 256, 8, 128, dtype=f16)
    kl, vl = torch.randn(1, 32768, 8, 128, dtype=f16), torch.randn(1, 32768, 8, 128, dtype=f16)
    lens = torch.tensor([200], dtype=torch.int32)
    kp, vp = torch.randn(64, 16, 8, 128, dtype=f16), torch.randn(64, 16, 8, 128, dtype=f16)
    table = torch.arange(16, dtype=torch.int32).reshape(1, 16)
    kn, vn = torch.randn(1, 1, 8, 128, dtype=f16), torch.randn(1, 1, 8, 128, dtype=f16)
    # A decode loop's int length, a token a step, each length once (past the calls timed).
    q1, k1, v1 = (torch.empty(1, n, h, 64, dtype=f16) for n, h in ((1, 8), (1 << 20, 1), (1 << 20, 1)))
    growing, bounds = itertools.count(1), itertools.count(0)
    fd = _api.flash_decode
    return {
        "plain": lambda: fd(q, k, v),
        "int cache_seqlens": lambda: fd(q, k, v, cache_seqlens=200),
        "int cache_seqlens, growing": lambda: fd(q1, k1, v1, cache_seqlens=next(growing)),
        "lengths + max_seqlen_k": lambda: fd(q, k, v, cache_seqlens=lens, max_seqlen_k=256),
        # A bound that grows a token a step (the batch's longest length), each value once.
        "lengths + growing bound": lambda: fd(q, kl, vl, cache_seqlens=lens, max_seqlen_k=next(bounds) % 32768 + 1),
        "lse, 32K workspace": lambda: fd(q, kl, vl, return_softmax_lse=True),
        "paged append": lambda: fd(q, kp, vp, kn, vn, cache_seqlens=lens, block_table=table, causal=True),
    }


def timed(call, calls, rounds):
    """(median, fastest) microseconds a call over rounds of calls."""
    for _ in range(calls // 10):
        call()
    per_call = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(per_call), min(per_call)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("case", nargs="*", help="cases to time (default: all)")
    args = p.parse_args(argv)
    _api._check_devices = lambda q, **others: 0  # CPU tensors on the fake device 0
    _api._current_stream = abs  # a C builtin where torch's stream getter would be
    table = cases()
    for name in args.case or table:
        med, best = timed(table[name], args.calls, args.rounds)
        print(f"{name:24s} {med:6.2f} us (fastest {best:.2f})")
    # The binding's Run alone, as the plain case makes it (a layout of 256 keys, no LSE).
    b, g = _native.binding(), 1 << 30
    q, kv = (4096, 4096, 128, 1), (256 * 1024, 1024, 128, 1)
    h = b.Prepare(1, 1, 1, 32, 8, 128, 256, *q, *kv, *kv, *q, 0.0, True, False, 0, 0, False)
    run = _api._fast(b, "Run")
    med, best = timed(lambda: run(h, -1, g, 64 * g, 128 * g, 2 * g, 0, 0, 0, 0, 0), args.calls, args.rounds)
    print(f"{'binding Run alone':24s} {med:6.2f} us (fastest {best:.2f})")


if __name__ == "__main__":
    main()
