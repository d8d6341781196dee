"""Decode steps from static, padded buffers (core/cuda_graphs.py).

Without a GPU the graphs are not captured (``capture=False``), but everything around them
is exercised: padding to the captured sizes, refilling the static buffers each step (rows a
larger batch used before become padding again), the scratch block that padded rows write,
and the backend's graph plan. Tokens and logits must equal the eager path's. With CUDA the
same test captures real graphs."""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the flash kernels run interpreted on CPU

import pytest  # noqa: E402

pytest.importorskip("triton")

from tessellm import LLM  # noqa: E402
from tessellm.core.model.cuda_graphs import capture_sizes  # noqa: E402


def test_capture_sizes_cover_every_batch_with_little_padding():
    sizes = capture_sizes(256)
    assert sizes[0] == 1 and sizes[-1] == 256 and sizes == sorted(set(sizes))
    for n in range(1, 257):
        padded = next(s for s in sizes if s >= n)
        assert padded - n < 8 and padded <= 2 * n
    assert capture_sizes(5) == [1, 2, 4, 5] and capture_sizes(1) == [1]


def _llm(cpu_config, model, graphs: bool, async_scheduling: bool = False, dtype: str = "float32"):
    llm = LLM(cpu_config(model, device="cuda" if CUDA else "cpu", attention={"name": "flash"}, dtype=dtype,
                         cache={"name": "paged", "options": {"block_size": 4, "num_blocks": 96}},
                         scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 32}},
                         decoding={"name": "greedy"}, cuda_graphs=False, async_scheduling=async_scheduling))
    if graphs:
        llm.pipeline.runner.capture_graphs(max_batch=6, max_model_len=64, capture=CUDA)
    return llm


def test_decode_graphs_give_the_eager_tokens(tiny_model, cpu_config):
    model = tiny_model("llama")
    eager, graphed = _llm(cpu_config, model, False), _llm(cpu_config, model, True)
    g = torch.Generator().manual_seed(0)
    # 7 requests with different lengths: batches shrink as they finish (6 -> padded sizes
    # 5 and 4 and below), and one batch exceeds the largest size and runs eagerly
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (3, 9, 14, 5, 22, 7, 11)]
    params = [{"max_tokens": m, "ignore_eos": True} for m in (4, 9, 6, 12, 3, 8, 10)]
    for llm in (eager, graphed):  # NaN marks every slot nobody wrote
        for layer in range(llm.pipeline.spec.num_layers):
            llm.pipeline.cache.layer(layer).k.fill_(float("nan"))
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == expected
    graphs = graphed.pipeline.runner.graphs
    assert graphs.replays >= 5
    cache = graphed.pipeline.cache
    assert cache.num_free_blocks == cache.num_blocks  # nothing leaked; the scratch block is not in the pool
    # the padded rows wrote only the scratch block: the other slots written are the eager run's
    scratch = cache.scratch_block * 4
    written = ~cache.layer(0).k.isnan().any(-1).any(-1)
    assert torch.equal(written[:scratch], ~eager.pipeline.cache.layer(0).k[:scratch].isnan().any(-1).any(-1))
    assert written[scratch:].any()  # padding happened, and went there


def test_graphs_with_async_scheduling_give_the_eager_tokens(tiny_model, cpu_config):
    """Replayed decode steps whose input ids are filled on the device from the previous
    step's tokens (async scheduling) give the synchronous eager engine's tokens."""
    model = tiny_model("llama")
    eager, graphed = _llm(cpu_config, model, False), _llm(cpu_config, model, True, async_scheduling=True)
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 6, 8)]
    params = [{"max_tokens": m, "ignore_eos": True} for m in (9, 4, 12, 7)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [o.token_ids for o in eager.generate(prompts, params)]
    assert graphed.engine.stats.overlapped_steps > 0 and graphed.pipeline.runner.graphs.replays > 0
    assert graphed.pipeline.cache.num_free_blocks == graphed.pipeline.cache.num_blocks


def test_decode_graph_logits_match_eager(tiny_model, cpu_config):
    model = tiny_model("llama")
    eager, graphed = _llm(cpu_config, model, False), _llm(cpu_config, model, True)
    prompt = list(range(5, 40))
    for llm in (eager, graphed):
        llm.generate([prompt], {"max_tokens": 2, "ignore_eos": True})
    # score is a prefill (eager in both); compare a decode step through each path instead
    from tessellm.core.interfaces.batch import ScheduledSeq
    from tessellm.core.engine.batch_builder import build_batch
    from tessellm.core.interfaces.sequence import SamplingParams, Sequence

    outs = []
    for llm in (eager, graphed):
        seqs = [Sequence(f"r{i}", prompt[: 10 + i], SamplingParams(max_tokens=1)) for i in range(3)]
        cache, runner = llm.pipeline.cache, llm.pipeline.runner
        for s in seqs:  # prefill eagerly, then one decode step of 3 (padded to 4 with graphs)
            cache.reserve(s, s.num_tokens)
            runner.forward(build_batch([ScheduledSeq(s, s.num_tokens - 1)], cache, runner.device))
            s.num_computed_tokens = s.num_tokens - 1
        outs.append(runner.forward(build_batch([ScheduledSeq(s, 1) for s in seqs], cache, runner.device)))
        for s in seqs:
            cache.free(s)
    assert graphed.pipeline.runner.graphs.replays >= 1
    assert (outs[0] - outs[1]).abs().max().item() < 1e-4


def test_graphs_are_refused_with_reasons(tiny_model, cpu_config):
    llm = LLM(cpu_config(tiny_model("llama")))  # sdpa + contiguous on CPU
    reason = llm.pipeline.runner.graphs_unsupported()
    assert reason is not None and ("cpu" in reason or "cuda" in reason)
    assert llm.pipeline.runner.graphs is None


def test_capture_out_of_memory_falls_back_to_eager(tiny_model, cpu_config, monkeypatch, caplog):
    """A capture that runs out of GPU memory leaves a working, eager engine and says why."""
    from tessellm.core.model.runner import ModelRunner

    def oom(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(ModelRunner, "graphs_unsupported", lambda self: None)
    monkeypatch.setattr(ModelRunner, "capture_graphs", oom)
    llm = LLM(cpu_config(tiny_model("llama"), decoding={"name": "greedy"}))
    assert llm.pipeline.runner.graphs is None
    assert "run eagerly" in caplog.text and "cuda_graph_max_batch" in caplog.text
    assert len(llm.generate([[5, 6, 7]], {"max_tokens": 3, "ignore_eos": True})[0].token_ids) == 3


@pytest.mark.parametrize("max_num_seqs, limit, captured", [(6, 512, 6), (300, 256, 256), (512, 512, 512)])
def test_graphs_are_captured_up_to_the_schedulers_batch_limit(tiny_model, cpu_config, monkeypatch, max_num_seqs,
                                                             limit, captured):
    """No decode batch outgrows the scheduler's sequences per step, so no larger graph is
    captured (each size costs capture time and pool memory)."""
    from tessellm.core.model.runner import ModelRunner

    asked = []
    monkeypatch.setattr(ModelRunner, "graphs_unsupported", lambda self: None)
    monkeypatch.setattr(ModelRunner, "capture_graphs", lambda self, max_batch, max_len: asked.append(max_batch))
    LLM(cpu_config(tiny_model("llama"), cache={"name": "paged", "options": {"num_blocks": 64}},
                   scheduler={"name": "continuous", "options": {"max_num_seqs": max_num_seqs}},
                   cuda_graph_max_batch=limit))
    assert asked == [captured]


def test_one_logits_buffer_serves_every_captured_size(tiny_model, cpu_config):
    """Every padded size writes the same static logits buffer, sized for the largest batch."""
    llm = _llm(cpu_config, tiny_model("llama"), True)
    graphs = llm.pipeline.runner.graphs
    assert graphs.logits.shape == (6, llm.pipeline.spec.vocab_size) and graphs.logits.dtype == torch.float32
    out = llm.generate([[5, 6, 7], [8, 9]], {"max_tokens": 4, "ignore_eos": True})
    assert all(len(o.token_ids) == 4 for o in out) and graphs.replays > 0


def test_bfloat16_graphs_hand_native_logits_to_argmax_only(tiny_model, cpu_config):
    """In a bfloat16 model the graphs' logits buffer is bfloat16, written by the LM head's
    GEMM directly. ``forward`` still returns float32 (the same values); ``native_logits``
    returns the buffer itself, which async steps hand to an argmax decoder
    (``device_tokens_any_dtype``): the tokens equal the synchronous eager engine's."""
    from tessellm.core.interfaces.batch import ScheduledSeq
    from tessellm.core.engine.batch_builder import build_batch
    from tessellm.core.interfaces.sequence import SamplingParams, Sequence

    model = tiny_model("llama")
    eager = _llm(cpu_config, model, False, dtype="bfloat16")
    graphed = _llm(cpu_config, model, True, async_scheduling=True, dtype="bfloat16")
    graphs = graphed.pipeline.runner.graphs
    assert graphs.logits.dtype == torch.bfloat16
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 6, 8)]
    params = [{"max_tokens": m, "ignore_eos": True} for m in (9, 4, 12, 7)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [o.token_ids for o in eager.generate(prompts, params)]
    assert graphed.engine.stats.overlapped_steps > 0 and graphs.replays > 0

    cache, runner = graphed.pipeline.cache, graphed.pipeline.runner
    seqs = [Sequence(f"r{i}", list(range(7, 17 + i)), SamplingParams(max_tokens=1)) for i in range(3)]
    for seq in seqs:  # prefill eagerly, then one decode step of 3 (padded to 4)
        cache.reserve(seq, seq.num_tokens)
        runner.forward(build_batch([ScheduledSeq(seq, seq.num_tokens - 1)], cache, runner.device))
        seq.num_computed_tokens = seq.num_tokens - 1
    batch = build_batch([ScheduledSeq(seq, 1) for seq in seqs], cache, runner.device)
    native = runner.forward(batch, native_logits=True).clone()
    as_float = runner.forward(batch)
    assert native.dtype == torch.bfloat16 and as_float.dtype == torch.float32
    assert torch.equal(native.float(), as_float) and not native.isnan().any()
    for seq in seqs:
        cache.free(seq)


def test_a_recording_replays_as_a_captured_graph_does():
    """tessellm.testing.graph_replay: a replay reruns the recorded operations on the tensors
    as they are at replay (in place, out=, functional ones into their recorded outputs,
    dtype conversions included) but keeps whatever the recording decided on the host: a
    Python number, a branch, a copy made before it (here a stale ``cached``)."""
    from tessellm.testing.graph_replay import Recording

    x, w, out = torch.randn(4, 8), torch.randn(8, 8), torch.empty(4, 8)
    positions = torch.arange(4)
    cached = w.clone()
    scale = float(x.abs().max())  # read before recording: a host value the graph keeps
    recording = Recording()
    with torch.inference_mode(), recording.record():
        h = torch.relu(x @ cached) * scale + positions.float()[:, None]
        torch.mm(h, w.t(), out=out)
        out.add_(1)
    for _ in range(2):
        x.copy_(torch.randn(4, 8))
        w.copy_(torch.randn(4, 8).repeat(2, 1))
        positions.copy_(torch.arange(4) * 3)
        recording.replay()
        want = (torch.relu(x @ cached) * scale + positions.float()[:, None]) @ w.t() + 1
        torch.testing.assert_close(out, want)
    assert not torch.equal(cached, w)


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: t.nonzero(), lambda t: t[t > 0],
                                  lambda t: bool((t > 0).any())])
def test_a_recording_refuses_host_reads_as_a_capture_does(read):
    from tessellm.testing.graph_replay import GraphCaptureError, Recording

    with pytest.raises(GraphCaptureError, match="host"):
        with Recording().record():
            read(torch.randn(6))


def test_a_recorded_triton_launch_keeps_its_grid_and_arguments():
    """A Triton launch (interpreted) replays with the grid and Python arguments of its
    recording: a launch sized by a host count covers only that many rows at replay."""
    import triton
    import triton.language as tl

    from tessellm.testing.graph_replay import Recording

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("records Triton launches under the interpreter")

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

    x = torch.zeros(64)
    recording = Recording()
    with recording.record():
        count = 20  # known on the host at capture
        add_one[(triton.cdiv(count, 16),)](x, count, BLOCK=16)
    assert x[:20].eq(1).all() and x[20:].eq(0).all()
    x.zero_()
    recording.replay()
    recording.replay()
    assert x[:20].eq(2).all() and x[20:].eq(0).all()
