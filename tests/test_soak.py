"""Soak tests of the eager path on the GPU: host and device memory over 10^5
calls, eight threads on eight streams, SIGINT while threads are in
flash_decode calls, and fork() after a call.

They take minutes, so they run only where the environment variable
FLASH_DECODE_SOAK=1 is set (and, like every `cuda` test, only with a GPU):

    FLASH_DECODE_SOAK=1 python -m pytest -q tests/test_soak.py
"""

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import flash_decode
from conftest import PACKAGE_PARENT, assert_matches_reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(os.environ.get("FLASH_DECODE_SOAK") != "1", reason="soak test: set FLASH_DECODE_SOAK=1"),
]

# The layout of the serving loop the tests stand for: b=2, 32/8 heads, d128,
# a cache of 4096 tokens, fp16, cache_seqlens an int32 tensor.
BATCH, HEADS_Q, HEADS_KV, HEADDIM, SEQLEN_CACHE = 2, 32, 8, 128, 4096


def make_inputs(seed=0, seqlen_cache=SEQLEN_CACHE):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).half()
    q = randn(BATCH, 1, HEADS_Q, HEADDIM)
    k = randn(BATCH, seqlen_cache, HEADS_KV, HEADDIM)
    v = randn(BATCH, seqlen_cache, HEADS_KV, HEADDIM)
    return q, k, v


def length_tensors(n, seed=0, seqlen_cache=SEQLEN_CACHE):
    """n cache_seqlens tensors of one layout with different values, made
    before the measurement so that the loop allocates none."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, seqlen_cache + 1, (BATCH,), generator=g, dtype=torch.int32).cuda() for _ in range(n)]


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_eager_calls_hold_host_and_device_memory():
    q, k, v = make_inputs()
    lens = length_tensors(97)

    def calls(n):
        for i in range(n):
            flash_decode.flash_decode(q, k, v, cache_seqlens=lens[i % len(lens)])
            if i % 1000 == 999:
                torch.cuda.synchronize()  # bounds the launch queue
        torch.cuda.synchronize()

    calls(10_000)  # warm-up: layout cache, allocator pools, lazy module state
    gc.collect()
    rss, reserved = rss_bytes(), torch.cuda.memory_reserved()
    calls(100_000)
    gc.collect()
    grown = rss_bytes() - rss
    assert grown <= 4 << 20, f"host RSS grew {grown / 2**20:.1f} MB over 10^5 calls"
    assert torch.cuda.memory_reserved() <= reserved, \
        f"memory_reserved grew from {reserved} to {torch.cuda.memory_reserved()} bytes"
    # The calls still compute the right thing.
    out, lse = flash_decode.flash_decode(q, k, v, cache_seqlens=lens[5], return_softmax_lse=True)
    assert_matches_reference(out, lse, q, k, v, cache_seqlens=lens[5])


THREADS = 8
CALLS_PER_THREAD = 2_000
# The threads test's cache: short enough that a call's GPU time stays below its host
# time, so that the threads' calls overlap on the host, where they contend.
SEQLEN_THREADS = 512


def decode_loop(q, k, v, lens, out, stream, calls, errors):
    """calls decodes on stream into out, cycling through lens; an exception
    goes to errors (a thread's exception would otherwise vanish)."""
    try:
        with torch.cuda.stream(stream):
            for i in range(calls):
                flash_decode.flash_decode(q, k, v, cache_seqlens=lens[i % len(lens)], out=out)
            stream.synchronize()
    except Exception as err:  # noqa: BLE001 (reported by the test)
        errors.append(err)


def test_threads_on_streams_match_one_thread():
    inputs = [make_inputs(seed=10 * t, seqlen_cache=SEQLEN_THREADS) for t in range(THREADS)]
    lens = [length_tensors(7, seed=t, seqlen_cache=SEQLEN_THREADS) for t in range(THREADS)]
    # One thread, the default stream: the expected results, after each
    # input's whole cycle of lengths (the last call's length decides out).
    expected = []
    for (q, k, v), ls in zip(inputs, lens):
        expected.append(flash_decode.flash_decode(q, k, v, cache_seqlens=ls[(CALLS_PER_THREAD - 1) % len(ls)]))
    torch.cuda.synchronize()

    def one_thread():
        outs = [torch.empty_like(q) for q, _, _ in inputs]
        stream = torch.cuda.Stream()
        errors = []
        for t in range(THREADS):
            decode_loop(*inputs[t], lens[t], outs[t], stream, CALLS_PER_THREAD, errors)
        torch.cuda.synchronize()
        assert not errors, errors
        return outs

    def many_threads():
        outs = [torch.empty_like(q) for q, _, _ in inputs]
        streams = [torch.cuda.Stream() for _ in range(THREADS)]
        errors = []
        threads = [threading.Thread(target=decode_loop, args=(*inputs[t], lens[t], outs[t], streams[t],
                                                              CALLS_PER_THREAD, errors))
                   for t in range(THREADS)]
        torch.cuda.synchronize()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        torch.cuda.synchronize()
        assert not errors, errors
        return outs

    # Every thread's results are one thread's, round after round. The throughput (8 threads
    # against one) is a benchmark's to show, not a test's: dev/threads.py measures it over
    # interleaved rounds (docs/reliability.md), where one run of a test moves with the host.
    for _ in range(3):
        for outs in (one_thread(), many_threads()):
            for got, want in zip(outs, expected):
                assert torch.equal(got, want)


def readline(child, timeout):
    """The child's next line of output, stripped; "" when it ends its output
    or says nothing for timeout seconds."""
    lines = []
    reader = threading.Thread(target=lambda: lines.append(child.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return lines[0].strip() if lines else ""


def start_child(code):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_PARENT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


# Four threads decode in a loop; the main thread waits for SIGINT, then
# stops and joins them. It prints "ready" once every thread has made calls,
# and "interrupted" the moment KeyboardInterrupt reaches it.
SIGINT_CHILD = f"""
import signal, sys, threading, time
import torch
import flash_decode

# Ctrl-C's handler, as a program started from a terminal has it (a job a shell starts in the
# background inherits SIGINT ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)

q = torch.randn({BATCH}, 1, {HEADS_Q}, {HEADDIM}, device="cuda", dtype=torch.float16)
k = torch.randn({BATCH}, {SEQLEN_CACHE}, {HEADS_KV}, {HEADDIM}, device="cuda", dtype=torch.float16)
v = torch.randn_like(k)
lens = torch.tensor([{SEQLEN_CACHE}, 1000], dtype=torch.int32, device="cuda")
stop = threading.Event()
counts = [0] * 4

def loop(t):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        while not stop.is_set():
            flash_decode.flash_decode(q, k, v, cache_seqlens=lens)
            counts[t] += 1
            if counts[t] % 100 == 0:
                stream.synchronize()
        stream.synchronize()

threads = [threading.Thread(target=loop, args=(t,)) for t in range(4)]
for th in threads:
    th.start()
try:
    while min(counts) < 100:
        time.sleep(0.001)
    print("ready", flush=True)
    while True:
        time.sleep(0.01)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    stop.set()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    print("joined", flush=True)
"""


def test_sigint_reaches_the_main_thread_while_threads_decode():
    child = start_child(SIGINT_CHILD)
    try:
        assert readline(child, 120) == "ready", "the child's threads made no calls"
        time.sleep(0.5)  # the threads are deep in their loops
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        line = readline(child, 10)
        latency = time.monotonic() - sent
        assert line == "interrupted", "no KeyboardInterrupt within 10 s"
        assert latency <= 1.0, f"KeyboardInterrupt took {latency:.2f} s"
        out, err = child.communicate(timeout=30)
        assert out.strip() == "joined" and child.returncode == 0, (child.returncode, out, err)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# A call, then fork(): the forked child imports torch, computes on the CPU and
# exits through the interpreter's normal shutdown; the parent reports the
# child's wait status.
FORK_CHILD = f"""
import os, sys
import torch
import flash_decode

q = torch.randn({BATCH}, 1, {HEADS_Q}, {HEADDIM}, device="cuda", dtype=torch.float16)
k = torch.randn({BATCH}, {SEQLEN_CACHE}, {HEADS_KV}, {HEADDIM}, device="cuda", dtype=torch.float16)
flash_decode.flash_decode(q, k, k, cache_seqlens=torch.tensor([5, 4096], dtype=torch.int32, device="cuda"))
torch.cuda.synchronize()
pid = os.fork()
if pid == 0:
    import torch  # noqa: F811 (the import in the child is the point)
    ok = torch.arange(4.0).sum().item() == 6.0
    sys.exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
"""


def test_fork_after_a_call_leaves_a_working_child():
    child = start_child(FORK_CHILD)
    try:
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert out.strip() == "0", f"forked child's exit code {out.strip()}: {err}"
