"""flash_decode.DecoderGraphs: a Decoder per batch-size bucket over static buffers, one CUDA
graph each. CPU tests drive it over the stand-in binding of fakes.py (bucket choice, padding,
the shared workspace, the addresses each call passes, lazy and up-front capture with a stand-in
graph); the cuda tests replay real graphs against flash_decode over changing batches."""

import pytest
import torch

import flash_decode
from conftest import assert_names
from fakes import layout_binding  # noqa: F401  (a fixture)
from flash_decode import _graphs
from test_decoder import no_allocation  # noqa: F401  (a fixture)


def example(batch=3, nheads_q=8, nheads_kv=2, headdim=64, pages=24, page_size=16, device="cpu"):
    q = torch.randn(batch, 1, nheads_q, headdim, device=device).half()
    k = torch.zeros(pages, page_size, nheads_kv, headdim, dtype=torch.float16, device=device)
    return q, k, torch.zeros_like(k)


class FakeGraph:
    """Stands in for a captured CUDA graph: replay runs the captured call again."""

    def __init__(self, call):
        self.call, self.replays = call, 0

    def replay(self):
        self.replays += 1
        self.call()


@pytest.fixture
def fake_capture(monkeypatch):
    captured = []

    def capture(call, device):
        captured.append(call)
        return FakeGraph(call)
    monkeypatch.setattr(_graphs, "_capture", capture)
    return captured


def test_buffers_decoders_and_one_shared_workspace(layout_binding):
    q, k, v = example()
    graphs = flash_decode.DecoderGraphs(q, k, v, buckets=(4, 1, 2, 2), max_blocks=6, causal=True, max_seqlen_k=96,
                                        return_softmax_lse=True)
    assert graphs.buckets == [1, 2, 4] and list(graphs.decoders) == [1, 2, 4]
    assert graphs.q.shape == graphs.out.shape == (4, 1, 8, 64) and graphs.lse.shape == (4, 8, 1)
    assert graphs.cache_seqlens.dtype == graphs.block_table.dtype == torch.int32
    assert graphs.block_table.shape == (4, 6) and graphs.workspace.numel() == layout_binding.need(96)
    layouts = [layout["batch"] for layout, _ in layout_binding.args("Prepare")]
    assert sorted(set(layouts)) == [1, 2, 4]
    for b in graphs.buckets:
        graphs.run(b)
        run = layout_binding.args("Run")[-1]
        assert run[2] == graphs.q.data_ptr() and run[5:9] == (graphs.out.data_ptr(), graphs.lse.data_ptr(),
                                                              graphs.cache_seqlens.data_ptr(),
                                                              graphs.block_table.data_ptr())
        assert run[-3:-1] == (graphs.workspace.data_ptr(), graphs.workspace.numel())


def test_a_step_is_padded_to_its_bucket_and_allocates_nothing(layout_binding, no_allocation):
    q, k, v = example()
    graphs = flash_decode.DecoderGraphs(q, k, v, buckets=(1, 2, 4, 8), max_blocks=6, max_seqlen_k=96)
    graphs.cache_seqlens.fill_(77)  # a previous step's lengths
    graphs.block_table.fill_(5)
    lens = torch.tensor([10, 0, 96], dtype=torch.int32)
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    no_allocation()
    assert graphs.prepare(lens, table, q) == 4
    assert graphs.cache_seqlens.tolist() == [10, 0, 96, 0, 77, 77, 77, 77]  # row 3 pads; 4-7 are not read
    assert torch.equal(graphs.block_table[:3, :4], table) and torch.equal(graphs.q[:3], q)
    assert graphs.run(4).shape == (4, 1, 8, 64)
    assert layout_binding.args("Run")[-1][2] == graphs.q.data_ptr()
    assert [graphs.bucket(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]


def test_steps_capture_each_bucket_once_and_replay(layout_binding, fake_capture):
    q, k, v = example(batch=8)
    graphs = flash_decode.DecoderGraphs(q, k, v, buckets=(1, 2, 4, 8), max_blocks=6, max_seqlen_k=96)
    for n in (3, 4, 1, 3, 8):
        out = graphs(q[:n], torch.full((n,), n, dtype=torch.int32), torch.zeros(n, 6, dtype=torch.int32))
        assert out.shape == (n, 1, 8, 64) and out.data_ptr() == graphs.out.data_ptr()
    assert sorted(graphs.graphs) == [1, 4, 8] and len(fake_capture) == 3
    assert [graphs.graphs[b].replays for b in (1, 4, 8)] == [1, 3, 1]
    graphs.capture()  # the rest, up front
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and len(fake_capture) == 4


def test_capture_up_front_goes_largest_first(layout_binding, fake_capture):
    q, k, v = example()
    graphs = flash_decode.DecoderGraphs(q, k, v, buckets=(1, 2, 4), max_blocks=6, return_softmax_lse=True)
    graphs.capture()
    assert list(graphs.graphs) == [4, 2, 1]
    out, lse = graphs(q, torch.ones(3, dtype=torch.int32))
    assert out.shape == (3, 1, 8, 64) and lse.shape == (3, 8, 1) and len(fake_capture) == 3


def test_per_sequence_options_are_sliced_per_bucket(layout_binding):
    q, k, v = example()
    slopes = torch.ones(4, 8)
    graphs = flash_decode.DecoderGraphs(q, k, v, buckets=(2, 4), max_blocks=6, alibi_slopes=slopes,
                                        sinks=torch.zeros(8))
    graphs.run(2)
    assert layout_binding.args("Run")[-1][11] == slopes.data_ptr()
    with pytest.raises(ValueError) as err:
        flash_decode.DecoderGraphs(q, k, v, buckets=(2, 8), max_blocks=6, alibi_slopes=slopes)
    assert_names(err.value, ValueError, "alibi_slopes")


@pytest.mark.parametrize("kwargs, name", [(dict(buckets=()), "buckets"), (dict(buckets=(0, 2)), "buckets"),
                                          (dict(buckets=4), "buckets"), (dict(max_blocks=0), "max_blocks")])
def test_construction_refusals_name_the_argument(layout_binding, kwargs, name):
    q, k, v = example()
    with pytest.raises(ValueError) as err:
        flash_decode.DecoderGraphs(q, k, v, **dict(dict(max_blocks=6), **kwargs))
    assert_names(err.value, ValueError, name)


def test_step_refusals_name_the_argument_and_write_nothing(layout_binding):
    q, k, v = example()
    graphs = flash_decode.DecoderGraphs(q, k, v, buckets=(1, 2, 4), max_blocks=6)
    lens = torch.ones(3, dtype=torch.int32)
    for args, name in (((torch.ones(5, dtype=torch.int32),), "cache_seqlens"),
                       ((torch.ones(1, 3, dtype=torch.int32),), "cache_seqlens"),
                       ((torch.ones(0, dtype=torch.int32),), "cache_seqlens"),
                       ((lens, torch.zeros(3, 7, dtype=torch.int32)), "block_table"),
                       ((lens, torch.zeros(2, 6, dtype=torch.int32)), "block_table"),
                       ((lens, [[0] * 6] * 3), "block_table"),
                       ((lens, None, q[:2]), "q")):
        with pytest.raises(ValueError) as err:
            graphs.prepare(*args)
        assert_names(err.value, ValueError, name)
    assert not graphs.cache_seqlens.any() and not graphs.block_table.any()
    dense = torch.zeros(4, 384, 2, 64, dtype=torch.float16)
    contiguous = flash_decode.DecoderGraphs(q, dense, dense, buckets=(4,))
    with pytest.raises(ValueError) as err:
        contiguous.prepare(lens, torch.zeros(3, 6, dtype=torch.int32))
    assert_names(err.value, ValueError, "block_table")


def test_contiguous_caches_give_each_bucket_its_first_rows(layout_binding):
    q, _, _ = example()
    k, v = torch.zeros(4, 384, 2, 64, dtype=torch.float16), torch.zeros(4, 384, 2, 64, dtype=torch.float16)
    graphs = flash_decode.DecoderGraphs(q, k, v, buckets=(1, 2, 4), max_seqlen_k=384)
    assert [layout["batch"] for layout, _ in layout_binding.args("Prepare")][-3:] == [1, 2, 4]
    assert graphs.prepare(torch.ones(2, dtype=torch.int32)) == 2
    graphs.run(2)
    assert layout_binding.args("Run")[-1][3:5] == (k.data_ptr(), v.data_ptr())
    with pytest.raises(ValueError) as err:
        flash_decode.DecoderGraphs(q, k[:2], v[:2], buckets=(1, 4))
    assert_names(err.value, ValueError, "k_cache")


# ---- on a GPU ----

def joining_and_leaving(steps, max_batch, max_len, g):
    """Per step, the batch's lengths: sequences join (length 1..max_len / 2), grow a key a step
    and leave at random or when full; a fresh generator-driven schedule."""
    lengths, schedule = [], []
    for _ in range(steps):
        lengths = [n + 1 for n in lengths if n < max_len and torch.rand((), generator=g) > 0.1]
        while len(lengths) < max_batch and torch.rand((), generator=g) < 0.5:
            lengths.append(int(torch.randint(1, max_len // 2, (), generator=g)))
        schedule.append(lengths or [1])
    return schedule


@pytest.mark.cuda
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=True, batch_invariant=True),
                                     dict(softcap=30.0, return_softmax_lse=True)],
                         ids=["causal", "invariant", "softcap lse"])
def test_replayed_steps_match_flash_decode_and_allocate_nothing(options):
    g = torch.Generator().manual_seed(0)
    page, max_blocks, max_batch = 16, 32, 12
    k, v = (torch.randn(max_batch * max_blocks, page, 4, 128, device="cuda").half() for _ in "kv")
    q = torch.randn(max_batch, 1, 16, 128, device="cuda").half()
    graphs = flash_decode.DecoderGraphs(q, k, v, buckets=(1, 2, 4, 8, 16), max_blocks=max_blocks,
                                        max_seqlen_k=max_blocks * page, **options)
    graphs.capture()
    torch.cuda.synchronize()
    flat, eager_kept = torch.cuda.memory_allocated(), 0
    for step, lengths in enumerate(joining_and_leaving(100, max_batch, max_blocks * page, g)):
        n = len(lengths)
        lens = torch.tensor(lengths, dtype=torch.int32).cuda()
        table = torch.randperm(k.shape[0], generator=g)[:n * max_blocks].view(n, max_blocks).to(torch.int32).cuda()
        qs = torch.randn(n, 1, 16, 128, generator=g).half().cuda()
        before = torch.cuda.memory_allocated()
        got = graphs(qs, lens, table)
        assert torch.cuda.memory_allocated() == before, step
        eager_before = torch.cuda.memory_allocated()
        want = flash_decode.flash_decode(qs, k, v, cache_seqlens=lens, block_table=table,
                                         max_seqlen_k=max_blocks * page, **options)
        for mine, theirs in zip(*((got, want) if isinstance(got, tuple) else ((got,), (want,)))):
            if options.get("batch_invariant"):
                assert torch.equal(mine, theirs), step  # another batch size: the same bits
            else:
                torch.testing.assert_close(mine, theirs, rtol=2e-3, atol=2e-3)
        # The eager reference keeps a workspace per layout it meets: counted apart from the graphs.
        del want, mine, theirs
        eager_kept += torch.cuda.memory_allocated() - eager_before
        del qs, lens, table
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == flat + eager_kept
