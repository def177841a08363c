"""Greedy decoding of a small Llama-style model with flash_decode on a paged KV cache.

What it shows: how a serving engine calls flash_decode at each decode step. One
call per layer appends the step's key and value into a paged cache (a block
table over pages of 16 tokens, allocated as sequences grow), rotates q and the
new key inside the call (rotary_cos / rotary_sin at cache_seqlens), and attends
over the sequence's whole cache:

    out = flash_decode(q, k_pages, v_pages, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                       cache_seqlens=seqlens, block_table=block_table, causal=True,
                       rotary_interleaved=False)

The model (RMSNorm, rotary, GQA attention, SwiGLU MLP) has random weights from a
fixed seed; a batch of prompts of different lengths is prefilled with torch SDPA.
The same model then decodes with SDPA over a dense cache, fed the same tokens,
and both runs must pick the same greedy token at every step (a step where the
dense run's two candidate logits are within --tie-tol is a numerical tie and is
reported, not failed). Tokens/s are printed for both runs.

    python examples/llama_decode.py                          # CUDA: flash_decode, 256 tokens
    python examples/llama_decode.py --decode sdpa-paged      # CUDA without flash_decode
    python examples/llama_decode.py --device cpu --tokens 8  # CPU: everything in plain torch

The first line printed names the decoder. Without a GPU the default is --device cpu, which
decodes with the plain-torch stand-in, not flash_decode; --decode flash there is refused.

``--decode sdpa-paged`` replaces flash_decode by ``paged_decode_torch``, a plain
torch function with the same arguments (rotate, write through the block table,
gather the pages, SDPA), which is what makes the example run on a CPU; the
second part below then uses its torch stand-in too.

If transformers is importable, a second part registers flash_decode as an
attention implementation through transformers' AttentionInterface, builds a tiny
LlamaForCausalLM from a config (random weights, nothing downloaded) and checks
that greedy generation picks the same tokens with it as with "sdpa". On a CPU the
registered function calls a torch stand-in for flash_decode. Without
transformers that part is skipped with a one-line message.

Exit status: 0 when every compared token matches, 1 otherwise.
"""

import argparse
import dataclasses
import random
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

PAGE_SIZE = 16
DECODERS = {"flash": "flash_decode",
            "sdpa-paged": "paged_decode_torch (plain torch, standing in for flash_decode)"}
ATTN_NAME = "splitkv_decode"  # flash_decode's name in transformers' AttentionInterface


@dataclasses.dataclass
class Config:
    vocab: int = 8192
    hidden: int = 1024
    layers: int = 4
    heads: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 2816
    rope_base: float = 10000.0
    eps: float = 1e-5


# --- the model ------------------------------------------------------------------------------------

def build_weights(cfg, seed, device, dtype):
    """Random weights, fan-in scaled so that activations stay O(1) in fp16."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    q_out, kv_out = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    layers = []
    for _ in range(cfg.layers):
        layers.append(dict(
            attn_norm=torch.ones(cfg.hidden, device=device, dtype=dtype),
            wq=w(cfg.hidden, q_out, scale=cfg.hidden ** -0.5),
            wk=w(cfg.hidden, kv_out, scale=cfg.hidden ** -0.5),
            wv=w(cfg.hidden, kv_out, scale=cfg.hidden ** -0.5),
            wo=w(q_out, cfg.hidden, scale=q_out ** -0.5),
            mlp_norm=torch.ones(cfg.hidden, device=device, dtype=dtype),
            w_gate=w(cfg.hidden, cfg.intermediate, scale=cfg.hidden ** -0.5),
            w_up=w(cfg.hidden, cfg.intermediate, scale=cfg.hidden ** -0.5),
            w_down=w(cfg.intermediate, cfg.hidden, scale=cfg.intermediate ** -0.5),
        ))
    return dict(embed=w(cfg.vocab, cfg.hidden, scale=1.0), layers=layers,
                final_norm=torch.ones(cfg.hidden, device=device, dtype=dtype),
                lm_head=w(cfg.hidden, cfg.vocab, scale=cfg.hidden ** -0.5))


def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope_tables(cfg, positions, device, dtype):
    """cos, sin (positions, head_dim / 2): fp32 angles, cast to the model dtype
    (flash_decode wants the tables in q's dtype)."""
    inv_freq = cfg.rope_base ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def rotate(x, cos, sin, positions, interleaved=False):
    """Rotary embedding of x (batch, seqlen, heads, head_dim) at positions
    (batch, seqlen), in fp32, rounded back to x's dtype. interleaved=False is
    Llama's rotate-half pairing (j, j + head_dim / 2)."""
    c = cos[positions].float().unsqueeze(2)
    s = sin[positions].float().unsqueeze(2)
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.to(x.dtype)


# SDPA's backends for a masked call, cuDNN left out: it builds a plan per new key length (tens of
# milliseconds), and a growing cache has a new length at every step.
SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_gqa(q, k, v, mask):
    """SDPA on (batch, seqlen, heads, head_dim) tensors, kv heads repeated for GQA."""
    group = q.shape[2] // k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.repeat_interleave(group, dim=2).transpose(1, 2)
    vt = v.repeat_interleave(group, dim=2).transpose(1, 2)
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)


def forward(cfg, weights, tokens, attend):
    """Logits (batch, seqlen, vocab) in fp32 of tokens (batch, seqlen); attend(layer,
    q, k, v) gets the un-rotated projections and returns the attention output."""
    x = weights["embed"][tokens]
    batch, seqlen = tokens.shape
    for i, lw in enumerate(weights["layers"]):
        h = rms_norm(x, lw["attn_norm"], cfg.eps)
        q = (h @ lw["wq"]).view(batch, seqlen, cfg.heads, cfg.head_dim)
        k = (h @ lw["wk"]).view(batch, seqlen, cfg.kv_heads, cfg.head_dim)
        v = (h @ lw["wv"]).view(batch, seqlen, cfg.kv_heads, cfg.head_dim)
        x = x + attend(i, q, k, v).reshape(batch, seqlen, -1) @ lw["wo"]
        h = rms_norm(x, lw["mlp_norm"], cfg.eps)
        x = x + (F.silu(h @ lw["w_gate"]) * (h @ lw["w_up"])) @ lw["w_down"]
    return (rms_norm(x, weights["final_norm"], cfg.eps) @ weights["lm_head"]).float()


# --- KV caches ------------------------------------------------------------------------------------

class DenseCache:
    """One (capacity, kv_heads, head_dim) row per sequence and layer; attention by SDPA."""

    def __init__(self, cfg, batch, capacity, rope, device, dtype):
        shape = (cfg.layers, batch, capacity, cfg.kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.cos, self.sin = rope
        self.lengths = [0] * batch

    def write(self, layer, seq, start, k, v):
        self.k[layer, seq, start:start + k.shape[0]] = k
        self.v[layer, seq, start:start + v.shape[0]] = v

    def attend(self, layer, q, k, v):
        """One new token per sequence: rotate, append at its length, attend over the cache."""
        lengths = torch.tensor(self.lengths, device=q.device)
        positions = lengths[:, None]
        q, k = rotate(q, self.cos, self.sin, positions), rotate(k, self.cos, self.sin, positions)
        rows = torch.arange(q.shape[0], device=q.device)
        self.k[layer, rows, lengths], self.v[layer, rows, lengths] = k[:, 0], v[:, 0]
        used = max(self.lengths) + 1
        mask = (torch.arange(used, device=q.device) <= lengths[:, None]).view(q.shape[0], 1, 1, used)
        return sdpa_gqa(q, self.k[layer, :, :used], self.v[layer, :, :used], mask)

    def advance(self):
        self.lengths = [n + 1 for n in self.lengths]


class PagedCache:
    """Pages of PAGE_SIZE tokens shared by all sequences, handed out from a
    shuffled free list as sequences grow; attention by a function with
    flash_decode's arguments, which also rotates and appends."""

    def __init__(self, cfg, batch, capacity, rope, device, dtype, decode_fn, seed):
        max_blocks = -(-capacity // PAGE_SIZE)
        num_blocks = batch * max_blocks
        shape = (cfg.layers, num_blocks, PAGE_SIZE, cfg.kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        # Entries past a sequence's pages point at block 0, as serving engines pad
        # them; flash_decode never reads past cache_seqlens + the new tokens.
        self.block_table = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
        self.pages = [0] * batch
        self.lengths = [0] * batch
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.cos, self.sin = rope
        self.decode_fn = decode_fn

    def reserve(self, seq, positions):
        """Give sequence seq enough pages for its first `positions` positions."""
        while self.pages[seq] * PAGE_SIZE < positions:
            self.block_table[seq, self.pages[seq]] = self.free.pop()
            self.pages[seq] += 1

    def write(self, layer, seq, start, k, v):
        positions = torch.arange(start, start + k.shape[0], device=k.device)
        blocks = self.block_table[seq].long()[positions // PAGE_SIZE]
        self.k[layer, blocks, positions % PAGE_SIZE] = k
        self.v[layer, blocks, positions % PAGE_SIZE] = v

    def begin_step(self):
        for seq, length in enumerate(self.lengths):
            self.reserve(seq, length + 1)

    def attend(self, layer, q, k, v):
        return self.decode_fn(q, self.k[layer], self.v[layer], k, v, rotary_cos=self.cos, rotary_sin=self.sin,
                              cache_seqlens=self.seqlens, block_table=self.block_table, causal=True,
                              rotary_interleaved=False)

    def advance(self):
        self.seqlens += 1  # flash_decode does not change cache_seqlens: the caller advances it
        self.lengths = [n + 1 for n in self.lengths]


def paged_decode_torch(q, k_cache, v_cache, k, v, *, rotary_cos, rotary_sin, cache_seqlens, block_table,
                       causal=True, rotary_interleaved=False):
    """flash_decode's paged append-and-attend in plain torch, for the arguments
    this example passes: rotate q and the new k (q rows at cache_seqlens + i when
    causal, all at cache_seqlens otherwise), write k, v through block_table at
    cache_seqlens, then SDPA over every page of the table with a bottom-right
    causal mask."""
    batch, seqlen_q = q.shape[:2]
    seqlen_new, page_size = k.shape[1], k_cache.shape[1]
    lengths = cache_seqlens.long()
    new_pos = lengths[:, None] + torch.arange(seqlen_new, device=q.device)
    q_pos = lengths[:, None] + (torch.arange(seqlen_q, device=q.device) if causal else 0)
    q = rotate(q, rotary_cos, rotary_sin, q_pos.expand(batch, seqlen_q), rotary_interleaved)
    k = rotate(k, rotary_cos, rotary_sin, new_pos, rotary_interleaved)
    blocks = block_table.long().gather(1, new_pos // page_size)
    k_cache[blocks, new_pos % page_size] = k
    v_cache[blocks, new_pos % page_size] = v
    keys = k_cache[block_table.long()].flatten(1, 2)        # (batch, max_blocks * page_size, kv_heads, d)
    values = v_cache[block_table.long()].flatten(1, 2)
    end = (lengths + seqlen_new).view(batch, 1, 1)
    j = torch.arange(keys.shape[1], device=q.device).view(1, 1, -1)
    mask = j < end
    if causal:
        mask = mask & (j <= end - seqlen_q + torch.arange(seqlen_q, device=q.device).view(1, -1, 1))
    return sdpa_gqa(q, keys, values, mask.unsqueeze(1))


# --- decoding -------------------------------------------------------------------------------------

def prefill(cfg, weights, prompts, cache):
    """Run each prompt through the model with causal SDPA, writing its rotated
    keys and values into cache; returns the first generated token per sequence."""
    first = []
    for seq, prompt in enumerate(prompts):
        n = prompt.shape[0]
        if isinstance(cache, PagedCache):
            cache.reserve(seq, n)
        positions = torch.arange(n, device=prompt.device)[None]

        def attend(layer, q, k, v):
            q, k = rotate(q, cache.cos, cache.sin, positions), rotate(k, cache.cos, cache.sin, positions)
            cache.write(layer, seq, 0, k[0], v[0])
            return sdpa_gqa(q, k, v, torch.ones(n, n, dtype=torch.bool, device=q.device).tril())

        first.append(int(forward(cfg, weights, prompt[None], attend)[0, -1].argmax()))
        cache.lengths[seq] = n
    if isinstance(cache, PagedCache):
        cache.seqlens.copy_(torch.tensor(cache.lengths, dtype=torch.int32))
    return first


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(cfg, weights, cache, first, steps, device, feed=None):
    """Greedy decode for `steps` tokens per sequence. Returns (tokens (steps, batch),
    logits (steps, batch, vocab) on the CPU, seconds). With feed (steps, batch),
    step t consumes feed[t - 1] instead of its own previous choice (teacher
    forcing), so that two runs can be compared at every step."""
    tokens, logits = [], []
    current = torch.tensor(first, device=device)
    sync(device)
    start = time.perf_counter()
    for t in range(steps):
        if t and feed is not None:
            current = feed[t - 1].to(device)
        if isinstance(cache, PagedCache):
            cache.begin_step()
        step_logits = forward(cfg, weights, current[:, None], cache.attend)[:, 0]
        cache.advance()
        current = step_logits.argmax(-1)
        tokens.append(current)
        logits.append(step_logits)
    sync(device)
    seconds = time.perf_counter() - start
    return torch.stack(tokens).cpu(), torch.stack(logits).cpu(), seconds


def compare(tokens, ref_tokens, ref_logits, tie_tol):
    """(mismatches, ties): steps where the reference chose another token, split
    by whether its logits for the two tokens were within tie_tol."""
    mismatches = ties = 0
    for t, b in (tokens != ref_tokens).nonzero().tolist():
        gap = float(ref_logits[t, b, ref_tokens[t, b]] - ref_logits[t, b, tokens[t, b]])
        if gap <= tie_tol:
            ties += 1
        else:
            mismatches += 1
    return mismatches, ties


def default_tie_tol(dtype):
    """20 rounding steps of dtype on logits of standard deviation about 1 (the
    weights are scaled for that): about 2e-2 in fp16, 0.16 in bf16."""
    return max(20 * torch.finfo(dtype).eps, 1e-4)


def run(device="cuda", decode_with=None, tokens=256, dtype=None, seed=0, cfg=None,
        prompt_lens=(37, 64, 5, 128), tie_tol=None, log=print):
    """The first part: returns a dict with both runs' tokens and timings and the comparison."""
    device = torch.device(device)
    cfg = cfg or Config()
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    if decode_with is None:
        decode_with = "flash" if device.type == "cuda" else "sdpa-paged"
    if tie_tol is None:
        tie_tol = default_tie_tol(dtype)
    if decode_with == "flash":
        from flash_decode import flash_decode as decode_fn
    else:
        decode_fn = paged_decode_torch
    torch.manual_seed(seed)
    weights = build_weights(cfg, seed, device, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(cfg.vocab, (n,), generator=g).to(device) for n in prompt_lens]
    capacity = max(prompt_lens) + tokens
    rope = rope_tables(cfg, capacity, device, dtype)
    log(f"model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads}/{cfg.kv_heads} heads of {cfg.head_dim}, "
        f"vocab {cfg.vocab}, {str(dtype).replace('torch.', '')} on {device.type}; "
        f"prompts of {list(prompt_lens)} tokens; pages of {PAGE_SIZE}")

    paged = PagedCache(cfg, len(prompts), capacity, rope, device, dtype, decode_fn, seed)
    first = prefill(cfg, weights, prompts, paged)
    out_tokens, out_logits, seconds = decode(cfg, weights, paged, first, tokens, device)
    dense = DenseCache(cfg, len(prompts), capacity, rope, device, dtype)
    ref_first = prefill(cfg, weights, prompts, dense)
    ref_tokens, ref_logits, ref_seconds = decode(cfg, weights, dense, first, tokens, device, feed=out_tokens)

    count = tokens * len(prompts)
    name = "flash_decode" if decode_with == "flash" else "paged_decode_torch"
    log(f"decode, {name} on the paged cache: {count} tokens in {seconds:.2f} s, {count / seconds:.0f} tokens/s")
    log(f"decode, SDPA on a dense cache:     {count} tokens in {ref_seconds:.2f} s, {count / ref_seconds:.0f} tokens/s")
    mismatches, ties = compare(out_tokens, ref_tokens, ref_logits, tie_tol)
    if first != ref_first:
        mismatches += sum(a != b for a, b in zip(first, ref_first))
    same = count - mismatches - ties
    diff = (out_logits - ref_logits).abs().max().item()
    log(f"greedy tokens: {same}/{count} identical, {ties} numerical ties, {mismatches} different "
        f"(max |logit difference| {diff:.2e})")
    return dict(tokens=out_tokens, ref_tokens=ref_tokens, mismatches=mismatches, ties=ties,
                tokens_per_s=count / seconds, ref_tokens_per_s=count / ref_seconds)


# --- transformers ---------------------------------------------------------------------------------

def dense_decode_torch(q, k_cache, v_cache, *, softmax_scale=None, causal=True):
    """flash_decode over a dense cache (batch, seqlen_cache, kv_heads, d) in plain
    torch: the stand-in registered with transformers on a CPU."""
    seqlen_q, seqlen_k = q.shape[1], k_cache.shape[1]
    mask = None
    if causal:
        rows = torch.arange(seqlen_q, device=q.device).view(-1, 1)
        mask = torch.arange(seqlen_k, device=q.device).view(1, -1) <= seqlen_k - seqlen_q + rows
    group = q.shape[2] // k_cache.shape[2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.repeat_interleave(group, 2).transpose(1, 2),
                                         v_cache.repeat_interleave(group, 2).transpose(1, 2), attn_mask=mask,
                                         scale=softmax_scale)
    return out.transpose(1, 2)


def set_attention(model, name):
    """Switch a transformers model's attention implementation (older releases
    lack set_attn_implementation and read the config field)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def run_transformers(device="cuda", tokens=64, dtype=None, seed=0, tie_tol=None, log=print, decode_with=None):
    """The second part: returns None when transformers is not installed, else a
    dict with both generations and the comparison. decode_with as in run:
    "flash" (the default on CUDA) registers flash_decode, anything else its
    torch stand-in."""
    try:
        import transformers
        from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        log("transformers is not installed: skipping the AttentionInterface part")
        return None
    device = torch.device(device)
    if dtype is None:
        dtype = torch.float16 if device.type == "cuda" else torch.float32
    if tie_tol is None:
        tie_tol = default_tie_tol(dtype)
    if decode_with is None:
        decode_with = "flash" if device.type == "cuda" else "sdpa-paged"
    if decode_with == "flash":
        from flash_decode import flash_decode as decode_fn
    else:
        decode_fn = dense_decode_torch

    def flash_decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """transformers hands over (batch, heads, seqlen, d) tensors, keys and
        values already rotated and concatenated by its cache. Prompts (more than
        16 query tokens) go to SDPA; decode steps to flash_decode, whose causal
        mask is aligned bottom-right as a decode step needs."""
        if query.shape[2] > 16:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        out = decode_fn(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                        softmax_scale=scaling, causal=True)
        return out, None

    # transformers takes any implementation name containing "flash" for a FlashAttention
    # kernel to load, so the name avoids that word.
    AttentionInterface.register(ATTN_NAME, flash_decode_attention)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=1024)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early, never mask a token
    prompt = torch.randint(config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    generated = {}
    for name in (ATTN_NAME, "sdpa"):
        set_attention(model, name)
        with torch.no_grad():
            generated[name] = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                             do_sample=False, pad_token_id=0)[:, prompt.shape[1]:]
    # The "sdpa" model scores flash_decode's sequence in one pass, so that every step is compared.
    with torch.no_grad():
        full = torch.cat([prompt, generated[ATTN_NAME]], dim=1)
        logits = model(full).logits[:, prompt.shape[1] - 1:-1].float().transpose(0, 1).cpu()
    out, ref = generated[ATTN_NAME].T.cpu(), logits.argmax(-1)
    mismatches, ties = compare(out, ref, logits, tie_tol)
    count = out.numel()
    log(f"transformers {transformers.__version__}: LlamaForCausalLM ({config.num_hidden_layers} layers, random "
        f"weights), flash_decode registered through AttentionInterface as \"{ATTN_NAME}\", against \"sdpa\": "
        f"{count - mismatches - ties}/{count} greedy tokens identical, {ties} numerical ties, {mismatches} different; "
        f"free-running generations {'identical' if torch.equal(generated[ATTN_NAME], generated['sdpa']) else 'differ'}")
    return dict(tokens=generated[ATTN_NAME], ref_tokens=generated["sdpa"], mismatches=mismatches, ties=ties)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--decode", choices=["flash", "sdpa-paged"], default=None,
                        help="flash: flash_decode (CUDA, the default there); sdpa-paged: the plain torch "
                             "paged decode (the default on a CPU)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens to decode per sequence")
    parser.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default=None,
                        help="default: fp16 on CUDA, fp32 on a CPU (fp32 needs --decode sdpa-paged: "
                             "flash_decode takes fp16 and bf16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tie-tol", type=float, default=None,
                        help="logit gap under which a different greedy token counts as a numerical tie "
                             "(default: 20 rounding steps of the dtype, 2e-2 in fp16)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers part")
    args = parser.parse_args(argv)
    if args.decode == "flash" and args.device == "cpu":
        parser.error("--decode flash needs --device cuda")
    if args.dtype == "fp32" and (args.decode or ("flash" if args.device != "cpu" else "")) == "flash":
        parser.error("--dtype fp32 needs --decode sdpa-paged: flash_decode takes fp16 and bf16")
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device} needs a CUDA GPU, and torch sees none: "
                     "--device cpu runs the example in plain torch (--decode sdpa-paged)")
    decoder = args.decode or ("flash" if args.device != "cpu" else "sdpa-paged")
    print(f"decoding with {DECODERS[decoder]}")
    dtype = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    result = run(args.device, args.decode, args.tokens, dtype, args.seed, tie_tol=args.tie_tol)
    ok = result["mismatches"] == 0
    if not args.no_transformers:
        hf = run_transformers(args.device, min(args.tokens, 64), dtype, args.seed, tie_tol=args.tie_tol,
                              decode_with=args.decode)
        ok = ok and (hf is None or hf["mismatches"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
