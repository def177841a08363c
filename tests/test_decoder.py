"""flash_decode.Decoder: a layout planned once, its workspace sized by the core, calls that
allocate nothing and refuse tensors of another layout by name. CPU tests drive the torch layer
over the stand-in binding of fakes.py; the cuda tests check it against flash_decode, eager and
replayed from a CUDA graph."""

import pytest
import torch

import flash_decode
from conftest import FAKEDEVICE, assert_names, capture, has_extension
from fakes import layout_binding  # noqa: F401  (a fixture)
from test_native import launch_on_fake_device


def tensors(batch=2, seqlen_q=1, nheads_q=8, nheads_kv=2, headdim=64, pages=6, page_size=16, device="cpu"):
    q = torch.zeros(batch, seqlen_q, nheads_q, headdim, dtype=torch.float16, device=device)
    k = torch.zeros(pages * batch, page_size, nheads_kv, headdim, dtype=torch.float16, device=device)
    lens = torch.zeros(batch, dtype=torch.int32, device=device)
    table = torch.arange(pages * batch, dtype=torch.int32, device=device).view(batch, pages)
    return q, k, torch.zeros_like(k), lens, table


@pytest.fixture
def no_allocation(monkeypatch):
    """After this fixture is entered, a torch allocation fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a Decoder call allocated a tensor")
    def arm():
        for name in ("empty", "empty_like", "zeros", "zeros_like", "empty_strided"):
            monkeypatch.setattr(torch, name, refuse)
    return arm


def test_construction_plans_the_bound_once(layout_binding):
    q, k, v, lens, table = tensors()
    dec = flash_decode.Decoder(q, k, v, cache_seqlens=lens, block_table=table, causal=True, max_seqlen_k=96)
    ((layout, device),) = layout_binding.args("Prepare")
    assert device == 0
    assert (layout["device_lengths"], layout["causal"], layout["page_size"], layout["max_pages"],
            layout["seqlen_cache"], layout["block_table"]) == (1, 1, 16, 6, 96, (6, 1))
    assert layout_binding.args("Workspace") == [(1, 96)]
    assert dec.workspace_bytes == layout_binding.need(96)


def test_without_a_bound_the_whole_cache_is_planned(layout_binding):
    q, k, v, lens, table = tensors()
    dec = flash_decode.Decoder(q, k, v, cache_seqlens=lens, block_table=table)
    assert layout_binding.args("Workspace") == [(1, -1)]
    assert dec.workspace_bytes == layout_binding.need(-1)


def test_a_call_passes_its_addresses_and_allocates_nothing(layout_binding, no_allocation):
    q, k, v, lens, table = tensors()
    dec = flash_decode.Decoder(q, k, v, cache_seqlens=lens, block_table=table, max_seqlen_k=96,
                               return_softmax_lse=True)
    no_allocation()
    outs = set()
    for _ in range(3):
        q2, lens2, table2 = q.clone(), lens.clone(), table.clone()  # new tensors of the same layout
        out, lse = dec(q2, k, v, cache_seqlens=lens2, block_table=table2)
        assert out.shape == q.shape and lse.shape == (2, 8, 1)
        (handle, seqlen, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seqlens, blocks, *rest) = layout_binding.args("Run")[-1]
        ws, ws_bytes, stream = rest[-3:]
        assert (handle, seqlen, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, seqlens, blocks) == (
            1, 96, q2.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), lens2.data_ptr(),
            table2.data_ptr())
        assert rest[:-3] == [0] * 11 and ws and ws_bytes == dec.workspace_bytes and stream == 0
        outs.add((out.data_ptr(), lse.data_ptr(), ws))
    assert len(outs) == 1  # the decoder's own out, lse and workspace, every call
    assert len(layout_binding.args("Prepare")) == 1 and len(layout_binding.args("Workspace")) == 1


def test_out_lse_and_optional_tensors_given_per_call(layout_binding, no_allocation):
    q, k, v, lens, _ = tensors(batch=2, pages=1, page_size=100)
    slopes, sinks = torch.ones(8), torch.zeros(8)
    dec = flash_decode.Decoder(q, k, v, cache_seqlens=lens, alibi_slopes=slopes, sinks=sinks,
                               return_softmax_lse=True)
    out, lse = torch.empty_like(q), torch.empty(2, 8, 1)
    slopes2 = slopes.clone()
    no_allocation()
    got = dec(q, k, v, alibi_slopes=slopes2, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    run = layout_binding.args("Run")[-1]
    assert run[5:9] == (out.data_ptr(), lse.data_ptr(), lens.data_ptr(), 0)  # the construction's lengths
    assert run[11] == slopes2.data_ptr() and run[18] == sinks.data_ptr()


def test_a_given_workspace_is_used_and_checked(layout_binding):
    q, k, v, lens, table = tensors()
    need = layout_binding.need(96)
    workspace = torch.empty(need + 7, dtype=torch.uint8)
    dec = flash_decode.Decoder(q, k, v, cache_seqlens=lens, block_table=table, max_seqlen_k=96, workspace=workspace)
    dec(q, k, v, cache_seqlens=lens, block_table=table)
    assert layout_binding.args("Run")[-1][-3:-1] == (workspace.data_ptr(), need + 7)
    for bad, exc in ((torch.empty(need - 1, dtype=torch.uint8), ValueError),
                     (torch.empty(need, dtype=torch.float32), ValueError),
                     (torch.empty(2, need, dtype=torch.uint8), ValueError),
                     (bytearray(need), TypeError)):
        with pytest.raises(exc) as err:
            flash_decode.Decoder(q, k, v, cache_seqlens=lens, block_table=table, max_seqlen_k=96, workspace=bad)
        assert_names(err.value, exc, "workspace")


def test_construction_refusals_name_the_argument(layout_binding):
    q, k, v, lens, table = tensors()
    for kwargs, exc, name in ((dict(cache_seqlens=5, block_table=table), TypeError, "cache_seqlens"),
                              (dict(block_table=table, max_seqlen_k=96), ValueError, "max_seqlen_k"),
                              (dict(cache_seqlens=lens, block_table=table, max_seqlen_k=1 << 64), ValueError,
                               "max_seqlen_k"),
                              (dict(cache_seqlens=lens, block_table=table, lse=torch.empty(2, 8, 1)), ValueError,
                               "lse"),
                              (dict(cache_seqlens=lens, block_table=table, return_softmax_lse=True,
                                    lse=torch.empty(2, 8, 2)), ValueError, "lse"),
                              (dict(cache_seqlens=lens, block_table=table[:1]), ValueError, "block_table")):
        with pytest.raises(exc) as err:
            flash_decode.Decoder(q, k, v, **kwargs)
        assert_names(err.value, exc, name)


CALL_REFUSALS = {
    "q of another batch": ("q", lambda t: dict(t, q=t["q"][:1])),
    "q of another dtype": ("q", lambda t: dict(t, q=t["q"].bfloat16())),
    "q missing": ("q", lambda t: dict(t, q=None)),
    "k_cache of other strides": ("k_cache", lambda t: dict(t, k_cache=t["k_cache"].transpose(0, 1).contiguous()
                                                           .transpose(0, 1))),
    "v_cache of fewer pages": ("v_cache", lambda t: dict(t, v_cache=t["v_cache"][:3])),
    "cache_seqlens int64": ("cache_seqlens", lambda t: dict(t, cache_seqlens=t["cache_seqlens"].long())),
    "block_table wider": ("block_table", lambda t: dict(t, block_table=torch.zeros(2, 7, dtype=torch.int32))),
    "block_table not a tensor": ("block_table", lambda t: dict(t, block_table=[[0]])),
    "out of another dtype": ("out", lambda t: dict(t, out=torch.empty(t["q"].shape))),
    "sinks not in the layout": ("sinks", lambda t: dict(t, sinks=torch.zeros(8))),
    "lse not in the layout": ("lse", lambda t: dict(t, lse=torch.zeros(2, 8, 1))),
}


@pytest.mark.parametrize("case", CALL_REFUSALS)
def test_a_call_off_the_layout_is_refused_by_name_before_run(layout_binding, case):
    name, mutate = CALL_REFUSALS[case]
    q, k, v, lens, table = tensors()
    dec = flash_decode.Decoder(q, k, v, cache_seqlens=lens, block_table=table)
    args = mutate(dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lens, block_table=table))
    with pytest.raises(ValueError) as err:
        dec(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)
    assert_names(err.value, ValueError, name)
    assert layout_binding.args("Run") == []


def test_a_core_refusal_is_raised_by_its_kind(layout_binding, monkeypatch):
    q, k, v, lens, table = tensors()
    monkeypatch.setattr(layout_binding, "Run", lambda *args: layout_binding.fail(2, "flashdecode: decode: q: nope"))
    dec = flash_decode.Decoder(q, k, v, cache_seqlens=lens, block_table=table)
    with pytest.raises(NotImplementedError, match="q: nope"):
        dec(q, k, v)


_THROUGH_THE_BINDING = """
import json, torch
import flash_decode
from flash_decode import _api
# CPU tensors pass as device 0's (the fake device launches nothing and logs each launch).
_api._device = lambda t: 0
_api._current_stream = lambda device: 0
q = torch.zeros(1, 1, 32, 128, dtype=torch.float16)
pages = torch.zeros(2048, 16, 8, 128, dtype=torch.float16)
lens, table = torch.zeros(1, dtype=torch.int32), torch.zeros(1, 2048, dtype=torch.int32)
result = []
for bound in (None, 1000):
    dec = flash_decode.Decoder(q, pages, pages, cache_seqlens=lens, block_table=table, max_seqlen_k=bound)
    dec(q, pages, pages)
    p = flash_decode.plan(1, 1, 32, 8, 128, 32768, page_size=16, lengths=True, seqlen=bound, device=0)
    result.append([dec.workspace_bytes, p["workspace_bytes"], p["kernel"], p["grid"]])
print(json.dumps(result))
"""


@pytest.mark.skipif(not has_extension(), reason="needs the native extension")
@pytest.mark.skipif(not (FAKEDEVICE / "libcuda.so.1").exists(), reason=f"no fake-device driver at {FAKEDEVICE}")
def test_the_core_sizes_the_workspace_and_plans_the_launch(tmp_path):
    # Through the real binding: workspace_bytes is the core's for the bound (plan() agrees), and a
    # call launches the plan of that bound.
    result, launches = launch_on_fake_device(_THROUGH_THE_BINDING, tmp_path)
    splits = [launch for launch in launches if launch[0].startswith("fd_split_kv_")]
    assert [[s[0], [int(x) for x in s[1:4]]] for s in splits] == [[kernel, grid] for _, _, kernel, grid in result]
    assert all(mine == core for mine, core, _, _ in result), result


# ---- on a GPU ----

def gpu_case(batch=4, pages=64, page_size=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, 1, 16, 128, generator=g, device="cuda").half()
    k, v = (torch.randn(batch * pages, page_size, 4, 128, generator=g, device="cuda").half() for _ in "kv")
    lens = torch.randint(1, pages * page_size + 1, (batch,), generator=g, device="cuda", dtype=torch.int32)
    table = torch.randperm(batch * pages, generator=g, device="cuda").to(torch.int32).view(batch, pages)
    return g, q, k, v, lens, table


@pytest.mark.cuda
@pytest.mark.parametrize("options", [dict(), dict(causal=True, softcap=30.0), dict(window_size=(100, 0)),
                                     dict(batch_invariant=True), dict(max_seqlen_k=1024, causal=True)],
                         ids=["plain", "causal softcap", "window", "invariant", "bound"])
def test_matches_flash_decode(options):
    _, q, k, v, lens, table = gpu_case()
    sinks = torch.randn(16, device="cuda")
    dec = flash_decode.Decoder(q, k, v, cache_seqlens=lens, block_table=table, sinks=sinks,
                               return_softmax_lse=True, **options)
    out, lse = dec(q, k, v, cache_seqlens=lens, block_table=table)
    want, want_lse = flash_decode.flash_decode(q, k, v, cache_seqlens=lens, block_table=table, sinks=sinks,
                                               return_softmax_lse=True, **options)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.cuda
def test_captured_once_replayed_over_100_steps():
    g, q, k, v, lens, table = gpu_case()
    bound = table.shape[1] * k.shape[1]
    dec = flash_decode.Decoder(q, k, v, cache_seqlens=lens, block_table=table, causal=True, max_seqlen_k=bound)
    graph, out = capture(lambda: dec(q, k, v, cache_seqlens=lens, block_table=table))
    torch.cuda.synchronize()
    flat = torch.cuda.memory_allocated()
    for step in range(100):
        # New queries, lengths and tables written in place, as an engine's step does.
        q.copy_(torch.randn(q.shape, generator=g, device="cuda"))
        lens.copy_(torch.randint(0, bound + 1, lens.shape, generator=g, device="cuda", dtype=torch.int32))
        table.copy_(torch.randperm(table.numel(), generator=g, device="cuda").view(table.shape))
        assert torch.cuda.memory_allocated() == flat, step
        graph.replay()
        assert torch.cuda.memory_allocated() == flat, step
        want = flash_decode.flash_decode(q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                                         max_seqlen_k=bound)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        del want
