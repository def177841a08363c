"""Host time of eager flash_decode calls through the public API only, so that two builds run the
same code: per case, the median over ROUNDS rounds of CALLS calls (us a call), as one JSON line.
Needs a GPU. Alternate builds in separate processes, e.g.

    for i in 1 2 3 4 5; do for b in base new; do PYTHONPATH=/tmp/$b python3 dev/eager_ab.py $b; done; done
"""
import json, statistics, sys, time
import torch, flash_decode

CALLS, ROUNDS = 300, 7
dev = "cuda"
def case_plain():
    q = torch.randn(1, 1, 32, 128, dtype=torch.float16, device=dev)
    k = torch.randn(1, 256, 8, 128, dtype=torch.float16, device=dev); v = torch.randn_like(k)
    return lambda: flash_decode.flash_decode(q, k, v)
def case_out():
    q = torch.randn(1, 1, 32, 128, dtype=torch.float16, device=dev)
    k = torch.randn(1, 256, 8, 128, dtype=torch.float16, device=dev); v = torch.randn_like(k)
    o = torch.empty_like(q)
    return lambda: flash_decode.flash_decode(q, k, v, out=o)
def case_lens():
    q = torch.randn(8, 1, 32, 128, dtype=torch.float16, device=dev)
    k = torch.randn(8, 1024, 8, 128, dtype=torch.float16, device=dev); v = torch.randn_like(k)
    lens = torch.full((8,), 700, dtype=torch.int32, device=dev)
    return lambda: flash_decode.flash_decode(q, k, v, cache_seqlens=lens, causal=True, return_softmax_lse=True)
def case_paged():
    q = torch.randn(8, 1, 32, 128, dtype=torch.float16, device=dev)
    k = torch.randn(64, 16, 8, 128, dtype=torch.float16, device=dev); v = torch.randn_like(k)
    bt = torch.arange(64, dtype=torch.int32, device=dev).reshape(8, 8)
    lens = torch.full((8,), 100, dtype=torch.int32, device=dev)
    return lambda: flash_decode.flash_decode(q, k, v, cache_seqlens=lens, block_table=bt)
CASES = {"plain": case_plain, "out": case_out, "lengths": case_lens, "paged": case_paged}
res = {}
for name, make in CASES.items():
    f = make(); f(); torch.cuda.synchronize()
    rounds = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for _ in range(CALLS):
            f()
        rounds.append((time.perf_counter() - t) / CALLS * 1e6)
        torch.cuda.synchronize()
    res[name] = statistics.median(rounds)
print(json.dumps({"build": sys.argv[1], **res}))
