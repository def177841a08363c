"""examples/llama_decode.py on the CPU: the plain-torch paged decode (rotate,
append through a shuffled block table, attend) picks the same greedy tokens as
SDPA over a dense cache, and the comparison does catch a wrong decode."""

import importlib.util

import pytest
import torch

from conftest import load_example


@pytest.fixture(scope="module")
def example():
    return load_example("llama_decode")


def small(example, **changes):
    """A smaller model than the example's default, so that CI stays fast: the same code path."""
    return example.Config(**dict(dict(vocab=2048, hidden=256, layers=2, heads=8, kv_heads=2, head_dim=32,
                                      intermediate=704), **changes))


def test_cpu_paged_decode_matches_dense_sdpa(example):
    lines = []
    result = example.run("cpu", tokens=8, cfg=small(example), log=lines.append)
    assert result["tokens"].shape == (8, 4)
    assert torch.equal(result["tokens"], result["ref_tokens"])
    assert result["mismatches"] == 0 and result["ties"] == 0
    assert any("32/32 identical" in line for line in lines)


def test_a_wrong_decode_is_caught(example, monkeypatch):
    """Rotary at interleaved pairs instead of Llama's halves: the tokens must differ."""
    right = example.paged_decode_torch

    def wrong(*args, **kwargs):
        return right(*args, **dict(kwargs, rotary_interleaved=True))

    monkeypatch.setattr(example, "paged_decode_torch", wrong)
    result = example.run("cpu", tokens=8, cfg=small(example), log=lambda line: None)
    assert result["mismatches"] > 0


def test_paged_decode_torch_writes_through_the_block_table(example):
    """The appended key lands in the page the block table names, rotated at cache_seqlens."""
    cos, sin = example.rope_tables(example.Config(head_dim=8), 32, "cpu", torch.float32)
    k_cache, v_cache = torch.zeros(6, 4, 1, 8), torch.zeros(6, 4, 1, 8)
    table = torch.tensor([[5, 2, 0], [1, 3, 4]], dtype=torch.int32)
    k_new, v_new = torch.randn(2, 1, 1, 8), torch.randn(2, 1, 1, 8)
    example.paged_decode_torch(torch.randn(2, 1, 2, 8), k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                               rotary_sin=sin, cache_seqlens=torch.tensor([6, 0], dtype=torch.int32),
                               block_table=table)
    want = example.rotate(k_new, cos, sin, torch.tensor([[6], [0]]))
    assert torch.equal(k_cache[2, 2], want[0, 0]) and torch.equal(v_cache[2, 2], v_new[0, 0])
    assert torch.equal(k_cache[1, 0], want[1, 0]) and torch.equal(v_cache[1, 0], v_new[1, 0])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


def test_transformers_part(example):
    lines = []
    result = example.run_transformers("cpu", tokens=8, log=lines.append)
    if importlib.util.find_spec("transformers") is None:
        assert result is None and lines == ["transformers is not installed: skipping the AttentionInterface part"]
    else:
        assert result["mismatches"] == 0 and torch.equal(result["tokens"], result["ref_tokens"])


def test_flash_needs_cuda(example):
    with pytest.raises(SystemExit):
        example.main(["--device", "cpu", "--decode", "flash"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
@pytest.mark.parametrize("argv", [["--device", "cuda"], ["--device", "cuda", "--decode", "flash"]])
def test_flash_is_refused_without_a_gpu(example, argv, capsys):
    with pytest.raises(SystemExit):
        example.main(argv)
    assert "--device cuda needs a CUDA GPU, and torch sees none" in capsys.readouterr().err


def test_the_first_line_names_the_decoder(example, monkeypatch, capsys):
    monkeypatch.setattr(example, "run", lambda *args, **kwargs: {"mismatches": 0})
    assert example.main(["--device", "cpu", "--no-transformers"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == \
        "decoding with paged_decode_torch (plain torch, standing in for flash_decode)"


@pytest.mark.parametrize("argv", [["--device", "cuda", "--dtype", "fp32"],
                                  ["--device", "cuda", "--decode", "flash", "--dtype", "fp32"]])
def test_fp32_needs_the_torch_decode(example, argv, capsys):
    # flash_decode takes fp16 and bf16: refused before the model is built, not at the first step.
    with pytest.raises(SystemExit):
        example.main(argv)
    assert "--dtype fp32 needs --decode sdpa-paged" in capsys.readouterr().err
