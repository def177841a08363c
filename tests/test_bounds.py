"""The GPU tests' bounds (conftest.bound_errors) have the power they exist for,
checked on the CPU: on test_long_cache's shape they pass what a correct kernel
computes and fail what one computes that skips the last key tile or one of 100
splits, with planted keys (conftest.plant) and without."""

import pytest
import torch

from conftest import bound_errors, plant, reference

KEYS_PER_TILE, SPLITS = 64, 100  # the head-dim-128 kernels' key tile; test_num_splits' largest count


def kernel_like(q, k, v, keep):
    """The kernels' math on the keys keep (seqlen_cache,) holds: fp32 scores,
    P = exp(s - max) rounded to the input dtype for P V while the sum keeps it
    unrounded, out rounded to the dtype. Returns (out, lse) as flash_decode does."""
    group = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2)
    vf = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~keep, float("-inf"))
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - m)
    l = p.sum(-1, keepdim=True)
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype).float() / l, vf)
    return out.to(q.dtype), (m + l.log()).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("planted", [False, True], ids=["random", "planted"])
def test_bounds_see_a_dropped_tile_or_split(dtype, planted):
    g = torch.Generator().manual_seed(0)
    n = 32768
    q, k, v = (torch.randn(*shape, generator=g).to(dtype) for shape in [(1, 1, 16, 128), (1, n, 2, 128), (1, n, 2, 128)])
    if planted:
        plant(q, k)
    ref_out, ref_lse = reference(q, k, v)
    tiles = torch.arange(n) // KEYS_PER_TILE
    last = int(tiles[-1])
    cases = {
        "correct": torch.ones(n, dtype=torch.bool),
        "last tile dropped": tiles != last,
        "the last tile's split dropped": tiles % SPLITS != last % SPLITS,
        "the middle key's split dropped": tiles % SPLITS != (n // 2 // KEYS_PER_TILE) % SPLITS,
    }
    for name, keep in cases.items():
        out, lse = kernel_like(q, k, v, keep)
        errors = bound_errors(out, lse, ref_out, ref_lse, dtype)
        assert (errors == "") == (name == "correct"), f"{name}: {errors or 'within the bounds'}"
