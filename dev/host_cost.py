"""Host time of eager flash_decode calls: the project's own part, or on a GPU every part.

    LD_LIBRARY_PATH=_build/ci/fakedevice python3 dev/host_cost.py [--calls 20000] [--rounds 7] [CASE ...]
    python3 dev/host_cost.py --gpu [--calls 200] [--rounds 50] [CASE ...]

Without --gpu it runs on make_libcuda.py's fake-device driver (`--fake-device`:
one sm_90 device whose launches cost nothing), with CPU tensors standing in
for CUDA ones: the device check and the stream getter are replaced, the rest
is the real call (the layout key, the Go core's checks, plan and launch path
through the gopy extension). That leaves out torch's CUDA allocator and the
driver's launch, which --gpu adds: the same calls on the GPU, and the eager
SDPA call BENCHMARKS.md compares with. The plain call (b=1, 32/8 heads, d128,
256 keys) runs on (b, s, h, d) tensors, and on SDPA's (b, h, s, d) ones passed
as views, which is BENCHMARKS.md's eager call. Either way its parts are also
timed alone: the call with `out` given, the allocation that skips, the binding's
Run (the Go core's path and the launch) of the call's plan and of one split
(a launch with no cluster), and on a GPU torch's stream getter. A round's
calls are timed on the host; on a GPU it is synchronized after the timer
stops, and rounds of a few hundred calls never fill the launch queue, so the
figures are host time however long the kernels take. Prints, per case, the
median and the fastest of --rounds rounds, in microseconds a call.
"""

import argparse
import functools
import itertools
import statistics
import time

import torch
import torch.nn.functional as F

import flash_decode  # noqa: F401  (the package under test, installed)
from flash_decode import _api


def cases(device):
    """name -> a call, each with its own tensors on device."""
    f16 = torch.float16
    randn, empty = (functools.partial(f, dtype=f16, device=device) for f in (torch.randn, torch.empty))
    q = randn(1, 1, 32, 128)
    k, v = randn(1, 256, 8, 128), randn(1, 256, 8, 128)
    kl, vl = randn(1, 32768, 8, 128), randn(1, 32768, 8, 128)
    lens = torch.tensor([200], dtype=torch.int32, device=device)
    kp, vp = randn(64, 16, 8, 128), randn(64, 16, 8, 128)
    table = torch.arange(16, dtype=torch.int32, device=device).reshape(1, 16)
    kn, vn = randn(1, 1, 8, 128), randn(1, 1, 8, 128)
    # A decode loop's int length, a token a step, each length once (past the calls timed).
    q1, k1, v1 = (empty(1, n, h, 64) for n, h in ((1, 8), (1 << 20, 1), (1 << 20, 1)))
    growing, bounds = itertools.count(1), itertools.count(0)
    # BENCHMARKS.md's eager call: SDPA's (b, h, s, d) tensors, passed as (b, s, h, d) views.
    sdpa = [randn(1, h, n, 128) for h, n in ((32, 1), (8, 256), (8, 256))]
    qt, kt, vt = (t.transpose(1, 2) for t in sdpa)
    fd = _api.flash_decode
    return {
        "plain": lambda: fd(q, k, v),
        "plain, (b, h, s, d) views": lambda: fd(qt, kt, vt),
        "int cache_seqlens": lambda: fd(q, k, v, cache_seqlens=200),
        "int cache_seqlens, growing": lambda: fd(q1, k1, v1, cache_seqlens=next(growing)),
        "lengths + max_seqlen_k": lambda: fd(q, k, v, cache_seqlens=lens, max_seqlen_k=256),
        # A bound that grows a token a step (the batch's longest length), each value once.
        "lengths + growing bound": lambda: fd(q, kl, vl, cache_seqlens=lens, max_seqlen_k=next(bounds) % 32768 + 1),
        "lse, 32K workspace": lambda: fd(q, kl, vl, return_softmax_lse=True),
        "paged append": lambda: fd(q, kp, vp, kn, vn, cache_seqlens=lens, block_table=table, causal=True),
    } | parts(q, k, v, sdpa, device)


def parts(q, k, v, sdpa, device):
    """The plain call's parts, each alone (see the module's doc); on a GPU,
    eager SDPA on sdpa, its (b, h, s, d) q, k and v."""
    fd, out, stream = _api.flash_decode, torch.empty_like(q), _api._current_stream
    table = {"plain, out given": lambda: fd(q, k, v, out=out),
             "torch.empty_like(q)": lambda: torch.empty_like(q)}
    for name, splits in (("binding Run alone", 0), ("binding Run, one split", 1)):
        run, h = _api._prepare(None, q, None, k_cache=k, v_cache=v, num_splits=splits, out=out)[:2]
        table[name] = lambda h=h, run=run: run(h, -1, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                               0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, stream(0))
    if device != "cpu":
        table["current stream"] = lambda: stream(0)
        table["torch SDPA"] = lambda: F.scaled_dot_product_attention(*sdpa, enable_gqa=True)
    return table


def timed(call, calls, rounds, sync):
    """(median, fastest) microseconds a call over rounds of calls, with
    sync() after each round, outside the timer."""
    for _ in range(max(calls // 10, 1)):
        call()
    sync()
    per_call = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append((time.perf_counter() - t) / calls * 1e6)
        sync()
    return statistics.median(per_call), min(per_call)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true", help="time on the CUDA GPU instead of the fake-device driver")
    p.add_argument("--calls", type=int, help="calls a round (default: 20000; 200 with --gpu)")
    p.add_argument("--rounds", type=int, help="rounds (default: 7; 50 with --gpu)")
    p.add_argument("case", nargs="*", help="cases to time (default: all)")
    args = p.parse_args(argv)
    calls, rounds = args.calls or (200 if args.gpu else 20000), args.rounds or (50 if args.gpu else 7)
    if args.gpu:
        device, sync = "cuda", torch.cuda.synchronize
    else:
        device, sync = "cpu", lambda: None
        _api._device = lambda t: 0  # CPU tensors on the fake device 0
        _api._current_stream = abs  # a C builtin where torch's stream getter would be
    table = cases(device)
    for name in args.case or table:
        med, best = timed(table[name], calls, rounds, sync)
        print(f"{name:26s} {med:6.2f} us (fastest {best:.2f})")


if __name__ == "__main__":
    main()
