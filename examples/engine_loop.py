"""A serving engine's decode loop over a paged KV cache, through flash_decode.DecoderGraphs.

What it shows: how an engine runs attention under CUDA graphs. A pool of pages (16 keys each)
is handed out by a block allocator; sequences join the running batch with prompts of random
lengths (their keys written into their pages, standing in for prefill) and leave at random or
when their pages run out, so the batch size changes from step to step. Each step appends one
key and value per sequence through its block table, then attends with one replay of the CUDA
graph of the smallest captured batch size that holds the batch (padding rows have length 0):

    graphs = flash_decode.DecoderGraphs(q, k_pages, v_pages, buckets=(1, 2, 4, 8, 16, 24, 32),
                                        max_blocks=max_blocks, causal=True, max_seqlen_k=max_len)
    out = graphs(q, cache_seqlens, block_table)   # copies in, pads, replays; allocates nothing

At every step a few sequences are checked against torch SDPA in fp32 over their own keys.

    python examples/engine_loop.py                            # 200 steps, up to 32 sequences
    python examples/engine_loop.py --steps 1000 --max-batch 64
    python examples/engine_loop.py --decode eager             # flash_decode calls, no graphs

The first line printed names the decoder. It needs a CUDA GPU and says so without one.
Exit status: 0 when every checked sequence matched, 1 otherwise.
"""

import argparse
import random
import sys
import time

import torch
import torch.nn.functional as F

PAGE_SIZE = 16
DECODERS = {"graphs": "flash_decode.DecoderGraphs (a flash_decode.Decoder per batch bucket, "
                      "each captured in a CUDA graph)",
            "eager": "flash_decode.flash_decode (one eager call a step, no graphs)"}
TOL = 4e-3  # fp16 output against the fp32 reference


def buckets_for(max_batch):
    """Batch sizes to capture, as vLLM's defaults go: 1, 2, 4, then every multiple of 8, up to
    max_batch (always included)."""
    return sorted({b for b in (1, 2, 4, *range(8, max_batch + 1, 8)) if b <= max_batch} | {max_batch})


class BlockAllocator:
    """Pages of a shared pool, handed out from a shuffled free list and given back on leave."""

    def __init__(self, num_blocks, seed):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, n):
        if n > len(self.free):
            raise MemoryError(f"{n} pages asked, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def give(self, blocks):
        self.free += blocks


class Sequence:
    def __init__(self, length, blocks):
        self.length, self.blocks = length, blocks


def write_prompt(k_pages, v_pages, seq, k, v):
    """A prompt's keys and values (length, nheads_kv, headdim) into seq's pages."""
    pos = torch.arange(k.shape[0])
    blocks = torch.tensor(seq.blocks)[pos // PAGE_SIZE].to(k_pages.device)
    offsets = (pos % PAGE_SIZE).to(k_pages.device)
    k_pages[blocks, offsets], v_pages[blocks, offsets] = k, v


def reference(q, k_pages, v_pages, seq):
    """fp32 SDPA of one sequence's q (1, nheads_q, headdim) over its own keys."""
    keys, values = (x[torch.tensor(seq.blocks, device=x.device)].flatten(0, 1)[:seq.length] for x in (k_pages, v_pages))
    group = q.shape[1] // keys.shape[1]
    kt, vt = (x.float().repeat_interleave(group, 1).transpose(0, 1) for x in (keys, values))
    return F.scaled_dot_product_attention(q.float().transpose(0, 1), kt, vt).transpose(0, 1)


def run(steps=200, max_batch=32, decode="graphs", max_len=2048, heads=(32, 8), headdim=128, checks=3, seed=0,
        device="cuda", log=print, attention=None):
    """The loop; returns {steps, tokens, worst, mismatches, buckets, seconds}. attention(k_pages,
    v_pages), where given, returns the attend(q, lens, table) that replaces flash_decode (tests on
    a CPU)."""
    import flash_decode

    rng, g = random.Random(seed), torch.Generator(device).manual_seed(seed)
    hq, hkv = heads
    max_blocks = -(-max_len // PAGE_SIZE)
    k_pages, v_pages = (torch.zeros(max_batch * max_blocks, PAGE_SIZE, hkv, headdim, device=device,
                                    dtype=torch.float16) for _ in "kv")
    allocator = BlockAllocator(k_pages.shape[0], seed)
    example = torch.zeros(max_batch, 1, hq, headdim, device=device, dtype=torch.float16)
    if attention is not None:
        attend = attention(k_pages, v_pages)
    elif decode == "graphs":
        attend = flash_decode.DecoderGraphs(example, k_pages, v_pages, buckets=buckets_for(max_batch),
                                            max_blocks=max_blocks, causal=True, max_seqlen_k=max_len)
    else:
        def attend(q, lens, table):
            return flash_decode.flash_decode(q, k_pages, v_pages, cache_seqlens=lens, block_table=table, causal=True,
                                             max_seqlen_k=max_len)
    running, sizes, worst, mismatches, start = [], [], 0.0, 0, time.perf_counter()
    for _ in range(steps):
        for seq in [s for s in running if s.length >= max_len or rng.random() < 0.05]:  # leave
            running.remove(seq)
            allocator.give(seq.blocks)
        while len(running) < max_batch and (not running or rng.random() < 0.6):  # join, with a prompt
            length = rng.randint(1, max_len // 2)  # below max_len: room for this step's token
            seq = Sequence(length, allocator.take(-(-length // PAGE_SIZE)))
            new = [torch.randn(length, hkv, headdim, device=device, generator=g).half() for _ in "kv"]
            write_prompt(k_pages, v_pages, seq, *new)
            running.append(seq)
        for seq in running:  # this step's token needs a page when the last one is full
            if seq.length == len(seq.blocks) * PAGE_SIZE:
                seq.blocks += allocator.take(1)
        n = len(running)
        table = torch.zeros(n, max_blocks, dtype=torch.int32)
        for i, seq in enumerate(running):
            table[i, :len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        table = table.to(device)
        # The step's new key and value, written through the block table at each sequence's length.
        pos = torch.tensor([s.length for s in running], device=device)
        blocks = table.gather(1, (pos // PAGE_SIZE)[:, None])[:, 0].long()
        k_pages[blocks, pos % PAGE_SIZE] = torch.randn(n, hkv, headdim, device=device, generator=g).half()
        v_pages[blocks, pos % PAGE_SIZE] = torch.randn(n, hkv, headdim, device=device, generator=g).half()
        for seq in running:
            seq.length += 1
        q = torch.randn(n, 1, hq, headdim, device=device, generator=g).half()
        out = attend(q, (pos + 1).to(torch.int32), table)
        for i in rng.sample(range(n), min(checks, n)):
            err = (out[i].float() - reference(q[i], k_pages, v_pages, running[i])).abs().max().item()
            worst = max(worst, err)
            mismatches += err > TOL
        sizes.append(n)
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    captured = sorted(getattr(attend, "graphs", {}))
    log(f"{steps} steps, {sum(sizes)} tokens, batches of {min(sizes)} to {max(sizes)} sequences on "
        f"{k_pages.shape[0]} pages of {PAGE_SIZE} "
        f"keys ({hq}/{hkv} heads, d{headdim}, up to {max_len} keys a sequence), {seconds:.2f} s"
        + (f"; graphs captured for batch sizes {captured}" if captured else ""))
    log(f"checked {min(checks, max_batch)} sequences a step against fp32 SDPA: worst |difference| {worst:.2e}, "
        f"{mismatches} past {TOL}")
    return dict(steps=steps, tokens=sum(sizes), sizes=sizes, worst=worst, mismatches=mismatches, buckets=captured,
                seconds=seconds)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="decode steps (default 200)")
    parser.add_argument("--max-batch", type=int, default=32, help="the most sequences running at once (default 32)")
    parser.add_argument("--decode", choices=list(DECODERS), default="graphs",
                        help="graphs: DecoderGraphs (the default); eager: a flash_decode call a step")
    parser.add_argument("--max-len", type=int, default=2048,
                        help="keys a sequence may reach, 2 or more (default 2048)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, least in (("steps", 1), ("max_batch", 1), ("max_len", 2)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be {least} or more, got {getattr(args, name)}")
    if not torch.cuda.is_available():
        parser.error("engine_loop.py runs flash_decode, which needs a CUDA GPU, and torch sees none")
    print(f"decoding with {DECODERS[args.decode]}")
    result = run(args.steps, args.max_batch, args.decode, args.max_len, seed=args.seed)
    return 0 if result["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
