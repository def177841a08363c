"""examples/engine_loop.py on the CPU: its arguments, its refusal without a GPU, and the loop
itself (block allocator, sequences joining and leaving, the block table, the append) with a
plain-torch paged attention standing in for flash_decode, checked by the loop's own SDPA
reference; a wrong stand-in is caught."""

import pytest
import torch
import torch.nn.functional as F

from conftest import load_example


@pytest.fixture(scope="module")
def example():
    return load_example("engine_loop")


def paged_attention(k_pages, v_pages, drop_last=False):
    """flash_decode's paged call for one query token in plain torch: gather each sequence's pages
    through the block table, mask past its length (and its last key, with drop_last), SDPA."""
    def attend(q, lens, table):
        keys, values = (x[table.long()].flatten(1, 2) for x in (k_pages, v_pages))  # (n, max keys, hkv, d)
        ends = lens.long()[:, None] - int(drop_last)
        mask = (torch.arange(keys.shape[1])[None] < ends)[:, None, None]  # (n, 1, 1, max keys)
        group = q.shape[2] // keys.shape[2]
        kt, vt = (x.float().repeat_interleave(group, 2).transpose(1, 2) for x in (keys, values))
        return F.scaled_dot_product_attention(q.float().transpose(1, 2), kt, vt, attn_mask=mask).transpose(1, 2)
    return attend


def small_run(example, steps=30, drop_last=False):
    lines = []
    result = example.run(steps=steps, max_batch=6, max_len=64, heads=(4, 2), headdim=16, device="cpu",
                         log=lines.append, attention=lambda k, v: paged_attention(k, v, drop_last))
    return result, lines


def test_the_loop_on_the_cpu_matches_sdpa(example):
    result, lines = small_run(example)
    assert result["mismatches"] == 0 and result["worst"] < 1e-3
    assert result["steps"] == 30 and result["tokens"] == sum(result["sizes"])
    assert min(result["sizes"]) < 6 == max(result["sizes"])  # sequences joined and left; the batch filled up
    assert lines[0].startswith("30 steps, ") and "checked 3 sequences a step" in lines[1]


def test_a_wrong_attention_is_caught(example):
    result, _ = small_run(example, drop_last=True)
    assert result["mismatches"] > 0


def test_buckets_follow_vllms_capture_sizes(example):
    assert example.buckets_for(32) == [1, 2, 4, 8, 16, 24, 32]
    assert example.buckets_for(3) == [1, 2, 3] and example.buckets_for(20) == [1, 2, 4, 8, 16, 20]


def test_the_allocator_hands_out_each_page_once(example):
    pages = example.BlockAllocator(10, seed=1)
    a, b = pages.take(4), pages.take(6)
    assert sorted(a + b) == list(range(10))
    with pytest.raises(MemoryError):
        pages.take(1)
    pages.give(a)
    assert sorted(pages.take(4)) == sorted(a)


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--max-batch", "-1"], ["--max-len", "1"],
                                  ["--decode", "magic"], ["--steps", "x"]])
def test_bad_arguments_are_refused(example, argv, capsys):
    with pytest.raises(SystemExit):
        example.main(argv)
    assert "error" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
@pytest.mark.parametrize("argv", [[], ["--decode", "eager", "--steps", "5"]])
def test_refused_without_a_gpu(example, argv, capsys):
    with pytest.raises(SystemExit) as exit:
        example.main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr()
    assert "needs a CUDA GPU, and torch sees none" in err.err and err.out == ""


@pytest.mark.cuda
@pytest.mark.parametrize("decode", ["graphs", "eager"])
def test_on_a_gpu(example, decode, capsys):
    assert example.main(["--steps", "50", "--max-batch", "12", "--decode", decode]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"decoding with {example.DECODERS[decode]}"
    if decode == "graphs":
        assert "graphs captured for batch sizes" in out[1]
