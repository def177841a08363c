"""flash_decode under torch.compile: a decode step compiles into one graph
(no graph break) around the custom ops flash_decode::decode and
flash_decode::decode_append, and gives what eager gives.

On CPU (CI) the ops get a CPU kernel for these tests only: a tiny plain-torch
decode (contiguous cache, optional append, causal), so that tracing, the fake
kernels, the schemas and the declared cache mutation are all checked without
a GPU. The GPU tests compile the real thing against eager flash_decode.
"""

import math

import pytest
import torch

import flash_decode
from conftest import cpu_kernels
from fakes import layout_binding  # noqa: F401  (a fixture)
from flash_decode import _ops

B, SQ, HQ, HKV, D, L = 2, 2, 8, 2, 64, 40


def tiny_decode(q, k_cache, v_cache, k, v, cache_seqlens, seqlen, softmax_scale, causal):
    """Decode with plain torch on a contiguous cache: write k, v at
    cache_seqlens + t into the caches (in place), then attend keys [0, len)
    with len = cache_seqlens + seqlen_new clamped to the cache, bottom-right
    causal. Returns (out in q's dtype, lse float32), both contiguous."""
    batch, seqlen_q, nheads_q, headdim = q.shape
    capacity, nheads_kv = k_cache.shape[1], k_cache.shape[2]
    if cache_seqlens is not None:
        lengths = cache_seqlens.tolist()
    else:
        lengths = [capacity if seqlen is None else seqlen] * batch
    seqlen_new = 0 if k is None else k.shape[1]
    scale = headdim ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((batch, nheads_q, seqlen_q), -math.inf)
    for b in range(batch):
        start = lengths[b]
        if k is not None:
            end = min(start + seqlen_new, capacity)
            k_cache[b, start:end] = k[b, :end - start]
            v_cache[b, start:end] = v[b, :end - start]
        n = min(max(start + seqlen_new, 0), capacity)
        keys = k_cache[b, :n].float().repeat_interleave(nheads_q // nheads_kv, dim=1)  # (n, hq, d)
        values = v_cache[b, :n].float().repeat_interleave(nheads_q // nheads_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[b].float(), keys) * scale
        if causal:
            rows = torch.arange(seqlen_q).view(-1, 1)
            scores = scores.masked_fill(torch.arange(n).view(1, -1) > n - seqlen_q + rows, -math.inf)
        lse[b] = torch.logsumexp(scores, dim=-1)
        probs = torch.nan_to_num(torch.exp(scores - lse[b].unsqueeze(-1)))  # rows with no key: 0
        out[b] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(q.dtype), lse


def _plain_only(window_left, window_right, softcap, **tensors):
    """The CPU kernels compute plain decode (and append): refuse the rest."""
    used = [name for name, t in tensors.items() if t is not None]
    if (window_left, window_right) != (-1, -1) or softcap != 0:
        used.append("window_size/softcap")
    if used:
        raise NotImplementedError(f"the test's CPU kernel does not compute {used}")


def _decode_cpu(q, k_cache, v_cache, cache_seqlens, seqlen, cache_batch_idx, cache_leftpad, block_table,
                softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, num_splits, max_seqlen_k=None):
    _plain_only(window_left, window_right, softcap, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                block_table=block_table, alibi_slopes=alibi_slopes)
    CALLS["decode"] += 1
    return tiny_decode(q, k_cache, v_cache, None, None, cache_seqlens, seqlen, softmax_scale, causal)


def _decode_append_cpu(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, seqlen, cache_batch_idx,
                       cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                       rotary_interleaved, alibi_slopes, num_splits, max_seqlen_k=None):
    _plain_only(window_left, window_right, softcap, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
                alibi_slopes=alibi_slopes)
    CALLS["decode_append"] += 1
    return tiny_decode(q, k_cache, v_cache, k, v, cache_seqlens, seqlen, softmax_scale, causal)


CALLS = {"decode": 0, "decode_append": 0}


@pytest.fixture
def cpu_ops():
    """The ops with the CPU kernels above, for one test (disabled after it:
    a CPU call then reaches the CUDA kernel's device check again)."""
    with cpu_kernels({"decode": _decode_cpu, "decode_append": _decode_append_cpu}):
        CALLS.update(decode=0, decode_append=0)
        yield CALLS


def inputs(device="cpu", dtype=torch.float16, seed=0, seqlen_new=1):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    return dict(q=randn(B, SQ, HQ, D), k_cache=randn(B, L, HKV, D), v_cache=randn(B, L, HKV, D),
                k=randn(B, seqlen_new, HKV, D), v=randn(B, seqlen_new, HKV, D),
                lens=torch.tensor([L - seqlen_new, 7], dtype=torch.int32, device=device))


def decode_step(q, k_cache, v_cache, lens):
    out, lse = flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                         return_softmax_lse=True)
    return out.float() * 2, lse.exp()


def append_step(q, k_cache, v_cache, k, v, lens):
    return flash_decode.flash_decode(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)


def assert_no_graph_break(fn, *args):
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    return explanation


def test_decode_compiles_into_one_graph(cpu_ops):
    a = inputs()
    args = (a["q"], a["k_cache"], a["v_cache"], a["lens"])
    explanation = assert_no_graph_break(decode_step, *args)
    assert "flash_decode.decode" in explanation.graphs[0].code

    compiled = torch.compile(decode_step, fullgraph=True, backend="aot_eager")
    out, p = compiled(*args)
    ref_out, ref_lse = tiny_decode(a["q"], a["k_cache"], a["v_cache"], None, None, a["lens"], None, None, True)
    torch.testing.assert_close(out, ref_out.float() * 2)
    torch.testing.assert_close(p, ref_lse.exp())
    # The graph's op is the one an eager call of the op runs.
    op_out, op_lse = torch.ops.flash_decode.decode(a["q"], a["k_cache"], a["v_cache"], a["lens"], None, None,
                                                   None, None, None, True, -1, -1, 0.0, None, 0)
    torch.testing.assert_close(out, op_out.float() * 2)
    torch.testing.assert_close(p, op_lse.exp())
    assert cpu_ops["decode"] >= 2 and cpu_ops["decode_append"] == 0


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_append_compiles_and_writes_the_caches(cpu_ops, backend):
    a = inputs(seqlen_new=2)
    args = (a["q"], a["k_cache"].clone(), a["v_cache"].clone(), a["k"], a["v"], a["lens"])
    explanation = assert_no_graph_break(append_step, *args)
    assert "flash_decode.decode_append" in explanation.graphs[0].code

    k_cache, v_cache = a["k_cache"].clone(), a["v_cache"].clone()
    compiled = torch.compile(append_step, fullgraph=True, backend=backend)
    out = compiled(a["q"], k_cache, v_cache, a["k"], a["v"], a["lens"])
    ref_k, ref_v = a["k_cache"].clone(), a["v_cache"].clone()
    ref_out, _ = tiny_decode(a["q"], ref_k, ref_v, a["k"], a["v"], a["lens"], None, None, True)
    torch.testing.assert_close(out, ref_out)
    # The new tokens landed in the caches the compiled function was given.
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert torch.equal(k_cache[0, L - 2:], a["k"][0]) and torch.equal(v_cache[1, 7:9], a["v"][1])
    assert not torch.equal(k_cache, a["k_cache"])


def test_compiled_steps_with_int_lengths_and_out(cpu_ops):
    """An int cache_seqlens that changes every step, out=, and an op between
    two decode calls: still one graph, and each step as eager computes it."""
    a = inputs()

    def step(q, k_cache, v_cache, k, v, n, out):
        flash_decode.flash_decode(q, k_cache, v_cache, k, v, cache_seqlens=n, out=out)
        return flash_decode.flash_decode(q * 0.5, k_cache, v_cache, cache_seqlens=n + 1, softmax_scale=0.3)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    k_cache, v_cache = a["k_cache"].clone(), a["v_cache"].clone()
    ref_k, ref_v = a["k_cache"].clone(), a["v_cache"].clone()
    for n in (10, 11, 12):
        out = torch.empty_like(a["q"])
        second = compiled(a["q"], k_cache, v_cache, a["k"], a["v"], n, out)
        ref_out, _ = tiny_decode(a["q"], ref_k, ref_v, a["k"], a["v"], None, n, None, False)
        ref_second, _ = tiny_decode(a["q"] * 0.5, ref_k, ref_v, None, None, None, n + 1, 0.3, False)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(second, ref_second)
        assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("case_id, make_out, kwargs, exc, pattern", [
    ("out in another dtype", lambda q: torch.empty(q.shape, dtype=torch.float32), {}, TypeError,
     r"out\b.*must have q's dtype"),
    ("out of a broadcastable shape", lambda q: torch.empty(B, 3, HQ, D, dtype=q.dtype), {}, ValueError,
     r"out\b.*must have q's shape"),
    # (After the traced call refuses, the eager call runs and refuses the CPU q first; the core names out
    # where it refuses first.)
    ("out on another device", lambda q: torch.empty(q.shape, dtype=q.dtype, device="meta"), {}, ValueError,
     "device"),
    ("causal as an int", None, dict(causal=1), TypeError, "causal must be a bool"),
])
def test_compiled_call_refuses_what_eager_refuses(cpu_ops, case_id, make_out, kwargs, exc, pattern):
    """out= is a copy of the op's result under torch.compile, and the ops'
    schemas turn 1 into True: both are checked at trace time, with the eager
    call's errors, instead of casting, broadcasting or converting."""
    a = inputs()

    def step(q, k_cache, v_cache, lens, out):
        return flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens, out=out, **kwargs)

    torch._dynamo.reset()
    # Without fullgraph the error reaches the caller as raised (fullgraph wraps it in dynamo's own).
    compiled = torch.compile(step, backend="aot_eager")
    out = None if make_out is None else make_out(a["q"])
    with pytest.raises(exc, match=pattern):
        compiled(a["q"], a["k_cache"], a["v_cache"], a["lens"], out)


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(num_splits=True), TypeError, "num_splits must be an int, got bool"),
    (dict(num_splits=2.0), TypeError, "num_splits must be an int, got float"),
    (dict(softmax_scale=True), TypeError, "softmax_scale must be a float or None, got bool"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be a float or None, got str"),
    (dict(softcap=True), TypeError, "softcap must be a float, got bool"),
    (dict(window_size=(True, -1)), TypeError, "window_size must be an int, got bool"),
    (dict(window_size=(4.0, 0)), TypeError, "window_size must be an int, got float"),
    (dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be an int, got bool"),
    (dict(cache_seqlens=[3, 7]), TypeError, "cache_seqlens must be None, an int or an int32 tensor"),
    (dict(q=torch.zeros(B, HQ, D, dtype=torch.float16)), ValueError, "q: invalid argument: must have 4 dimensions"),
], ids=lambda x: None if isinstance(x, (dict, type)) else x.split(",")[0][:24])
def test_compiled_call_checks_arguments_at_trace_time(cpu_ops, kwargs, exc, pattern):
    """The ops' schemas would convert True to 1 and 1.0, and a wrong type or
    rank would fail inside the fake kernel: the traced call refuses each as
    the eager call does, before any op runs (fullgraph: no eager fallback)."""
    a = inputs()
    kwargs = dict(kwargs)
    q = kwargs.pop("q", a["q"])
    lens = kwargs.pop("cache_seqlens", a["lens"])

    def step(q, k_cache, v_cache):
        return flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens, **kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=pattern) as raised:
        compiled(q, a["k_cache"], a["v_cache"])
    # fullgraph wraps the error in dynamo's own, which shows it as raised.
    assert isinstance(raised.value, exc) or f"{exc.__name__}(" in str(raised.value), raised.value
    assert cpu_ops == {"decode": 0, "decode_append": 0}


@pytest.mark.parametrize("options", [
    lambda n: dict(cache_seqlens=n, softmax_scale=n * 0.01),
    lambda n: dict(num_splits=n),
    lambda n: dict(max_seqlen_k=n),
    lambda n: dict(cache_seqlens=n, window_size=(n + 3, 0)),
    lambda n: dict(cache_seqlens=n, softcap=n * 0.5),
], ids=["softmax_scale", "num_splits", "max_seqlen_k", "window_size", "softcap"])
def test_symbolic_options_trace_in_one_graph(cpu_ops, options):
    """With dynamic=True ints and floats are symbolic while the step is traced:
    the trace-time checks take them (their values are checked when the op
    runs), and the step compiles whole."""
    a = inputs()

    def step(q, k_cache, v_cache, lens, n):
        kwargs = options(n)
        kwargs.setdefault("cache_seqlens", lens)
        return flash_decode.flash_decode(q, k_cache, v_cache, **kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    refused = 0  # calls that reached the op, whose CPU kernel here has no window or softcap
    for n in (10, 11):
        try:
            compiled(a["q"], a["k_cache"], a["v_cache"], a["lens"], n)
        except NotImplementedError as err:
            assert "the test's CPU kernel does not compute" in str(err)
            refused += 1
    assert cpu_ops["decode"] + refused == 2


# ---- merge_states under torch.compile: the op flash_decode::merge_states ----

MERGES = []


def _merge_states_cpu(outs, lses):
    """The merge formula in float32 (rows with a live state only), as the op's CPU kernel."""
    MERGES.append((tuple(outs.shape), tuple(lses.shape)))
    m = lses.amax(0)
    w = torch.exp(lses - m)
    total = w.sum(0)
    out = (w.unsqueeze(-1) * outs.float()).sum(0) / total.unsqueeze(-1)
    return out.to(outs.dtype), m + torch.log(total)


@pytest.fixture
def cpu_merge():
    with cpu_kernels({"merge_states": _merge_states_cpu}):
        MERGES.clear()
        yield MERGES


def test_merge_states_compiles_to_its_op(cpu_merge):
    g = torch.Generator().manual_seed(3)
    outs = [torch.randn(2, 4, 64, generator=g).half() for _ in range(3)]
    lses = [torch.randn(2, 4, generator=g) for _ in range(3)]

    def step(outs, lses, a, b):
        out, lse = flash_decode.merge_states(outs, lses)
        return flash_decode.merge_state(out, lse, a, b)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    out, lse = compiled(outs, lses, outs[0] * 2, lses[0] - 1)
    # A list is stacked into the op; merge_state is the op of two states.
    assert cpu_merge == [((3, 2, 4, 64), (3, 2, 4)), ((2, 2, 4, 64), (2, 2, 4))]
    want_out, want_lse = _merge_states_cpu(torch.stack(outs), torch.stack(lses))
    want_out, want_lse = _merge_states_cpu(torch.stack([want_out, outs[0] * 2]), torch.stack([want_lse, lses[0] - 1]))
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


@pytest.mark.parametrize("outs, lses, pattern", [
    (torch.zeros(3, 4, 64, dtype=torch.int32), torch.zeros(3, 4), "outs: wrong type: must be torch.float16"),
    (torch.zeros(3, 4, 64), torch.zeros(3, 4, dtype=torch.float16), "lses: wrong type: must be torch.float32"),
    (torch.zeros(3, 4, 64), torch.zeros(2, 4), "lses: invalid argument: must hold num_states=3"),
], ids=["outs int32", "lses fp16", "counts differ"])
def test_compiled_merge_checks_arguments_at_trace_time(cpu_merge, outs, lses, pattern):
    compiled = torch.compile(flash_decode.merge_states, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=pattern):
        compiled(outs, lses)
    assert cpu_merge == []


def test_merge_opcheck(cpu_merge):
    g = torch.Generator().manual_seed(4)
    torch.library.opcheck(_ops.merge_states, (torch.randn(3, 2, 5, 32, generator=g), torch.randn(3, 2, 5, generator=g)))


def test_eager_calls_do_not_go_through_the_ops(cpu_ops, layout_binding):
    a = inputs()
    flash_decode.flash_decode(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=a["lens"])
    assert len(layout_binding.args("Run")) == 1
    assert cpu_ops == {"decode": 0, "decode_append": 0}


def op_args(a, append):
    """Positional arguments of decode / decode_append for inputs a."""
    if append:
        return (a["q"], a["k_cache"].clone(), a["v_cache"].clone(), a["k"], a["v"], None, None, a["lens"], None,
                None, None, None, None, True, -1, -1, 0.0, True, None, 0, None)
    return (a["q"], a["k_cache"], a["v_cache"], a["lens"], None, None, None, None, 0.125, False, -1, -1, 0.0, None, 0, None)


@pytest.mark.parametrize("append", [False, True], ids=["decode", "decode_append"])
def test_opcheck(cpu_ops, append):
    # Schema (with the caches declared mutated exactly when they are), fake
    # kernel against the real one, and AOT dispatch.
    op = torch.ops.flash_decode.decode_append if append else torch.ops.flash_decode.decode
    torch.library.opcheck(op.default, op_args(inputs(), append))


def test_fake_kernels_match_the_results(cpu_ops):
    a = inputs(dtype=torch.bfloat16)
    for append in (False, True):
        args = op_args(a, append)
        op = _ops.decode_append if append else _ops.decode
        out, lse = op(*args)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake_args = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in args]
            fake_out, fake_lse = op(*fake_args)
        for real, fake in ((out, fake_out), (lse, fake_lse)):
            assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
        assert out.dtype == torch.bfloat16 and lse.shape == (B, HQ, SQ)


# ---- on the GPU: the real ops against eager flash_decode ----

def gpu_inputs(dtype=torch.float16, page_size=16, seqlen_new=1):
    """A paged cache (random block order, from serving_ref.make_paged) and new tokens."""
    from serving_ref import make_paged
    a = inputs("cuda", dtype, seqlen_new=seqlen_new)
    g = torch.Generator().manual_seed(1)
    k_paged, v_paged, block_table = make_paged(a["k_cache"], a["v_cache"], page_size, generator=g)
    a.update(k_paged=k_paged, v_paged=v_paged, block_table=block_table)
    return a


def paged_append_step(q, k_cache, v_cache, k, v, lens, block_table):
    out, lse = flash_decode.flash_decode(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=block_table,
                                         causal=True, window_size=(16, -1), return_softmax_lse=True)
    return out * 1.0, lse


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_cuda_decode_step_compiles_and_matches_eager(backend):
    torch._dynamo.reset()
    a = inputs("cuda")
    args = (a["q"], a["k_cache"], a["v_cache"], a["lens"])
    assert_no_graph_break(decode_step, *args)
    compiled = torch.compile(decode_step, fullgraph=True, backend=backend)
    for got, want in zip(compiled(*args), decode_step(*args)):
        torch.testing.assert_close(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_cuda_paged_append_step_compiles_and_matches_eager(backend):
    torch._dynamo.reset()
    a = gpu_inputs()
    assert_no_graph_break(paged_append_step, a["q"], a["k_paged"].clone(), a["v_paged"].clone(), a["k"], a["v"],
                          a["lens"], a["block_table"])
    compiled = torch.compile(paged_append_step, fullgraph=True, backend=backend)
    k_c, v_c = a["k_paged"].clone(), a["v_paged"].clone()
    k_e, v_e = a["k_paged"].clone(), a["v_paged"].clone()
    for step in range(3):  # the caller advances the lengths; the new tokens land one further each step
        lens = a["lens"] + step
        got = compiled(a["q"], k_c, v_c, a["k"] + step, a["v"], lens, a["block_table"])
        want = paged_append_step(a["q"], k_e, v_e, a["k"] + step, a["v"], lens, a["block_table"])
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y)
        assert torch.equal(k_c.nan_to_num(), k_e.nan_to_num()) and torch.equal(v_c.nan_to_num(), v_e.nan_to_num())


@pytest.mark.cuda
def test_cuda_compiled_call_refuses_what_the_core_refuses():
    # The core's checks run when the op runs: more than 16 query tokens is prefill's work.
    torch._dynamo.reset()
    a = inputs("cuda")
    q = torch.zeros(B, 17, HQ, D, dtype=torch.float16, device="cuda")
    compiled = torch.compile(decode_step, fullgraph=True, backend="aot_eager")
    with pytest.raises(NotImplementedError, match="seqlen_q: not supported: 17"):
        compiled(q, a["k_cache"], a["v_cache"], a["lens"])


@pytest.mark.cuda
def test_cuda_compiled_step_in_a_cuda_graph():
    """A compiled append+paged step captured in a CUDA graph and replayed with
    new lengths and new tokens (written into the captured tensors)."""
    torch._dynamo.reset()
    a = gpu_inputs()
    compiled = torch.compile(paged_append_step, fullgraph=True, backend="aot_eager")
    k_c, v_c = a["k_paged"].clone(), a["v_paged"].clone()
    lens, k_new = a["lens"].clone(), a["k"].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        compiled(a["q"], k_c.clone(), v_c.clone(), k_new, a["v"], lens, a["block_table"])  # warm up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = compiled(a["q"], k_c, v_c, k_new, a["v"], lens, a["block_table"])
    k_e, v_e = a["k_paged"].clone(), a["v_paged"].clone()
    for step in range(3):
        lens.copy_(a["lens"] + step)
        k_new.copy_(a["k"] * (step + 1))
        graph.replay()
        want_out, want_lse = paged_append_step(a["q"], k_e, v_e, k_new, a["v"], lens, a["block_table"])
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(lse, want_lse)
        assert torch.equal(k_c.nan_to_num(), k_e.nan_to_num())


@pytest.mark.cuda
@pytest.mark.parametrize("append", [False, True], ids=["decode", "decode_append"])
def test_cuda_opcheck(append):
    op = torch.ops.flash_decode.decode_append if append else torch.ops.flash_decode.decode
    torch.library.opcheck(op.default, op_args(inputs("cuda"), append))


def cascade_step(q, k_prefix, v_prefix, k, v, lens):
    """Cascade attention: a shared prefix and each sequence's own keys, merged."""
    o1, l1 = flash_decode.flash_decode(q, k_prefix, v_prefix, return_softmax_lse=True)
    o2, l2 = flash_decode.flash_decode(q, k, v, cache_seqlens=lens, return_softmax_lse=True)
    return flash_decode.merge_states([o1, o2], [l1.transpose(1, 2), l2.transpose(1, 2)])


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_cuda_cascade_step_compiles_and_matches_eager(backend):
    torch._dynamo.reset()
    a = inputs("cuda")
    prefix = [x[:1].expand(B, -1, -1, -1) for x in (a["k_cache"] * 0.5, a["v_cache"])]
    args = (a["q"], *prefix, a["k_cache"], a["v_cache"], a["lens"])
    assert_no_graph_break(cascade_step, *args)
    compiled = torch.compile(cascade_step, fullgraph=True, backend=backend)
    for got, want in zip(compiled(*args), cascade_step(*args)):
        torch.testing.assert_close(got, want)


@pytest.mark.cuda
def test_cuda_merge_opcheck():
    g = torch.Generator(device="cuda").manual_seed(5)
    outs = torch.randn(3, 2, 5, 64, generator=g, device="cuda", dtype=torch.float16)
    torch.library.opcheck(_ops.merge_states, (outs, torch.randn(3, 2, 5, generator=g, device="cuda")))
