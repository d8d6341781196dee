"""The one mixture-of-experts block (core/model/moe.py) checked four ways: its grouped path
against its reference loop, its router against a plain per-token re-implementation, the
block against transformers' own Mixtral / Qwen2-MoE / Qwen3-MoE blocks, and a checkpoint
whose experts are stacked as 3-D tensors against the same weights stored per expert."""

from __future__ import annotations

import itertools
import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tessellm import LLM
from tessellm.core.model.moe import MoE, Router, unstack_experts
from tessellm.core.model.spec import ModelSpec, MoESpec
from tessellm.testing.equivalence import assert_close_in_float32, greedy_divergence

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]
VOCAB = 512


# ---------------------------------------------------------------- drawn routing variants


ROUTINGS = [f"{method}/{scoring}" for method in ("greedy", "group_limited_greedy", "noaux_tc")
            for scoring in ("softmax", "sigmoid")] + ["softmax_after_topk"]
"""Each top-k method with each scoring, and the softmax over the top-k logits: every one is a
test case of its own, the other options drawn."""


@st.composite
def moe_specs(draw, routing: str) -> MoESpec:
    """A MoESpec routed as ``routing`` (a ROUTINGS entry; top_k never above what the kept
    groups hold) with the rest drawn: a choice bias, renormalised and/or scaled weights,
    shared experts with or without their gate."""
    after_topk = routing == "softmax_after_topk"
    method, scoring = ("greedy", "softmax") if after_topk else routing.split("/")
    if method == "greedy":
        groups = topk_group = None
        experts = draw(st.integers(1, 12))
        top_k = draw(st.integers(1, experts))
    else:
        groups = draw(st.integers(1, 4))
        size = draw(st.integers(2 if method == "noaux_tc" else 1, 4))  # noaux_tc sums a group's two best
        experts, topk_group = groups * size, draw(st.integers(1, groups))
        top_k = draw(st.integers(1, topk_group * size))
    shared = draw(st.sampled_from([0, 8, 20]))
    return MoESpec(
        num_experts=experts, top_k=top_k, intermediate_size=draw(st.integers(1, 12)), sparse_layers=frozenset({0}),
        shared_intermediate_size=shared, shared_gate=shared > 0 and draw(st.booleans()), scoring=scoring,
        topk_method=method, num_groups=groups, topk_group=topk_group,
        norm_topk_prob=not after_topk and draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
        score_bias=not after_topk and draw(st.booleans()), softmax_after_topk=after_topk)


def model_spec(moe: MoESpec, hidden: int) -> ModelSpec:
    """A one-layer spec around ``moe``: only the hidden size and the MoE matter to the block."""
    return ModelSpec(model_type="test", vocab_size=16, hidden_size=hidden, intermediate_size=moe.intermediate_size,
                     num_layers=1, num_heads=1, num_kv_heads=1, head_dim=hidden, rms_norm_eps=1e-6,
                     max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                     mlp_bias=False, sliding_window=None, rope_type="default", hf_config=None, moe=moe)


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``module`` in float64 with every parameter and buffer (the score bias too) drawn from
    N(0, 0.5^2): wide enough that the router's choices are far from ties."""
    module.double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64) * 0.5)
    return module


def tokens_of(hidden: int, count: int, seed: int) -> torch.Tensor:
    """[count, hidden] float64 hidden states."""
    return torch.randn(count, hidden, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)


@pytest.mark.parametrize("routing", ROUTINGS)
@settings(max_examples=12, deadline=None)
@given(data=st.data(), hidden=st.integers(4, 24), tokens=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_grouped_path_equals_the_reference(routing, data, hidden, tokens, seed):
    """After stack_experts the batched products over stacked weights give the reference
    loop's output, for every routing variant and token count (shared experts included)."""
    moe = data.draw(moe_specs(routing), label="moe")
    block = randomized(MoE(model_spec(moe, hidden)), seed)
    x = tokens_of(hidden, tokens, seed)
    with torch.no_grad():
        reference = block(x)
        block.stack_experts()
        assert block.grouped
        grouped = block(x)
    assert grouped.shape == x.shape
    assert (grouped - reference).abs().max().item() < 1e-12


# ---------------------------------------------------------------- the router, token by token


def route_token(logits: list[float], bias: list[float], moe: MoESpec) -> dict[int, float]:
    """One token's {expert: weight}, as MoESpec's docstring states the routing, in Python
    floats (float64)."""
    experts = range(len(logits))
    if moe.softmax_after_topk:
        chosen = sorted(experts, key=lambda e: -logits[e])[:moe.top_k]
        exps = {e: math.exp(logits[e] - logits[chosen[0]]) for e in chosen}
        return {e: v / sum(exps.values()) * moe.routed_scaling_factor for e, v in exps.items()}
    if moe.scoring == "softmax":
        exps = [math.exp(v - max(logits)) for v in logits]
        scores = [v / sum(exps) for v in exps]
    else:
        scores = [1 / (1 + math.exp(-v)) for v in logits]
    choice = [s + b for s, b in zip(scores, bias)] if moe.score_bias else scores
    allowed = list(experts)
    if moe.topk_method != "greedy":
        size = len(logits) // moe.num_groups
        members = [list(range(g * size, (g + 1) * size)) for g in range(moe.num_groups)]
        if moe.topk_method == "noaux_tc":
            strength = [sum(sorted((choice[e] for e in m), reverse=True)[:2]) for m in members]
        else:
            strength = [max(choice[e] for e in m) for m in members]
        kept = sorted(range(moe.num_groups), key=lambda g: -strength[g])[:moe.topk_group]
        allowed = [e for g in kept for e in members[g]]
    chosen = sorted(allowed, key=lambda e: -choice[e])[:moe.top_k]
    total = sum(scores[e] for e in chosen) if moe.norm_topk_prob else 1.0
    return {e: scores[e] / total * moe.routed_scaling_factor for e in chosen}


@pytest.mark.parametrize("routing", ROUTINGS)
@settings(max_examples=12, deadline=None)
@given(data=st.data(), hidden=st.integers(4, 24), tokens=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_router_matches_a_per_token_reimplementation(routing, data, hidden, tokens, seed):
    """The chosen experts and their weights are those MoESpec describes, token by token."""
    moe = data.draw(moe_specs(routing), label="moe")
    router = randomized(Router(model_spec(moe, hidden)), seed)
    x = tokens_of(hidden, tokens, seed)
    with torch.no_grad():
        ids, weights = router(x)
        logits = x @ router.weight.T  # [T, E]
    assert ids.shape == weights.shape == (tokens, moe.top_k) and weights.dtype == torch.float64
    bias = router.e_score_correction_bias.tolist() if moe.score_bias else [0.0] * moe.num_experts
    for t in range(tokens):
        expected = route_token(logits[t].tolist(), bias, moe)
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert sorted(got) == sorted(expected), t
        assert all(abs(got[e] - expected[e]) < 1e-12 for e in expected), t


# ---------------------------------------------------------------- against transformers


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Per family: (a tiny random checkpoint saved per expert, transformers' model of it in
    float64 with its eager expert loop)."""
    from transformers import AutoModelForCausalLM

    from tessellm.testing.models import build_tiny

    built = {}
    for model_type in FAMILIES:
        folder = build_tiny(model_type, tmp_path_factory.mktemp(model_type), vocab_size=VOCAB)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager")
        built[model_type] = folder, hf.eval()
    return built


@pytest.fixture(scope="module")
def blocks(families) -> dict[str, tuple[torch.nn.Module, MoE]]:
    """Per family: (transformers' first MoE block, ours loaded with its weights in float64).
    Its in-memory experts are 3-D stacks (transformers v5), split by ``unstack_experts``;
    Qwen2-MoE's ``shared_expert`` is our ``shared_experts``."""
    pairs = {}
    for model_type, (_, hf) in families.items():
        theirs = next(layer.mlp for layer in hf.model.layers if hasattr(layer.mlp, "experts"))
        ours = MoE(ModelSpec.from_hf_config(hf.config)).double()
        state = unstack_experts(theirs.state_dict())
        state = {k.replace("shared_expert.", "shared_experts."): v for k, v in state.items()}
        ours.load_state_dict(state, strict=True)
        pairs[model_type] = theirs, ours.eval()
    return pairs


@pytest.mark.parametrize("model_type", FAMILIES)
@settings(max_examples=10, deadline=None)
@given(tokens=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_block_matches_transformers(blocks, model_type, tokens, seed):
    """The same experts, weights and output as transformers' block; its routing weights are
    float32, so weights and outputs agree to about 1e-7."""
    theirs, ours = blocks[model_type]
    x = tokens_of(ours.gate.weight.shape[1], tokens, seed)
    with torch.no_grad():
        ids, weights = ours.gate(x)
        _, their_weights, their_ids = theirs.gate(x)
        out, their_out = ours(x), theirs(x[None])[0]
    order, their_order = ids.argsort(dim=-1), their_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), their_ids.gather(1, their_order))
    assert (weights.gather(1, order) - their_weights.gather(1, their_order)).abs().max().item() < 1e-6
    assert (out - their_out).abs().max().item() < 1e-6


# ---------------------------------------------------------------- a checkpoint with stacked experts


def stacked_copy(folder: Path, hf: torch.nn.Module, target: Path) -> Path:
    """A copy of ``folder`` whose model.safetensors is transformers' in-memory state dict
    (experts as 3-D stacks), in the checkpoint's dtype."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(folder, target)
    with safe_open(folder / "model.safetensors", "pt") as f:
        dtype = f.get_tensor(next(iter(f.keys()))).dtype
    tied = hf.config.tie_word_embeddings
    state = {k: v.to(dtype).contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert any(v.dim() == 3 for v in state.values())
    save_file(state, target / "model.safetensors")
    return target


@pytest.mark.parametrize("model_type", FAMILIES)
def test_stacked_checkpoint_loads_as_the_per_expert_one(families, model_type, tmp_path):
    """The same weights read from 3-D expert stacks and from per-expert tensors give the same
    logits within float32 rounding and the same greedy tokens (up to a near-tie). Not bit for
    bit: the two files place the tensors at different offsets, and a CPU's matrix kernels may
    block differently by alignment (seen on an AVX-512 EPYC)."""
    folder, hf = families[model_type]
    stacked = stacked_copy(folder, hf, tmp_path / "stacked")
    per_expert, from_stacks = (LLM({"model": str(f), "device": "cpu", "dtype": "float32"}) for f in (folder, stacked))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 19)]
    assert_close_in_float32(from_stacks.engine.score(prompts[2]), per_expert.engine.score(prompts[2]), model_type)
    params = {"max_tokens": 8, "ignore_eos": True}
    got, expected = (llm.generate(prompts, params) for llm in (from_stacks, per_expert))
    for prompt, ours, theirs in zip(prompts, got, expected):
        greedy_divergence(ours.token_ids, theirs.token_ids, lambda done: per_expert.engine.score(prompt + done)[-1],
                          f"{model_type}, prompt of {len(prompt)}")


def test_stacks_are_let_go_when_a_quantizer_replaces_the_experts():
    """The grouped path's float stacks go once the experts are no nn.Linear any more, and
    the block then runs the reference over the replaced experts."""
    from tessellm.core.model.moe import drop_stale_stacks

    moe = randomized(MoE(model_spec(MoESpec(num_experts=4, top_k=2, intermediate_size=8,
                                            sparse_layers=frozenset({0})), 16)), seed=1)
    x = tokens_of(16, 5, seed=2)
    moe.stack_experts()
    assert moe.grouped and moe._stacked is not None
    expected = moe(x)
    for expert in moe.experts:  # what a quantizer's swap looks like: another module at the name
        expert.down_proj = torch.nn.Sequential(expert.down_proj)
    drop_stale_stacks(moe)
    assert not moe.grouped and moe._stacked is None
    assert torch.allclose(moe(x), expected, atol=1e-12)


def test_unstack_experts_reads_the_interleaved_transposed_layout():
    """GPT-OSS's stacks: gate_up_proj [E, H, 2I] with gate and up in alternate columns,
    down_proj [E, I, H], and their bias stacks, split into each expert's Linear weights and
    biases that compute the same products."""
    g = torch.Generator().manual_seed(3)
    experts, hidden, width = 3, 6, 4
    gate_up = torch.randn(experts, hidden, 2 * width, generator=g, dtype=torch.float64)
    down = torch.randn(experts, width, hidden, generator=g, dtype=torch.float64)
    gate_up_bias = torch.randn(experts, 2 * width, generator=g, dtype=torch.float64)
    down_bias = torch.randn(experts, hidden, generator=g, dtype=torch.float64)
    prefix = "model.layers.0.mlp.experts"
    state = unstack_experts({f"{prefix}.gate_up_proj": gate_up, f"{prefix}.down_proj": down,
                             f"{prefix}.gate_up_proj_bias": gate_up_bias, f"{prefix}.down_proj_bias": down_bias,
                             "model.norm.weight": torch.ones(hidden)}, "interleaved_transposed")
    x = torch.randn(5, hidden, generator=g, dtype=torch.float64)

    def linear(e: int, proj: str, inputs: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(inputs, state[f"{prefix}.{e}.{proj}.weight"], state[f"{prefix}.{e}.{proj}.bias"])

    for e in range(experts):
        fused = x @ gate_up[e] + gate_up_bias[e]  # [5, 2I]: the checkpoint's own product
        torch.testing.assert_close(linear(e, "gate_proj", x), fused[:, 0::2])
        torch.testing.assert_close(linear(e, "up_proj", x), fused[:, 1::2])
        h = torch.randn(5, width, generator=g, dtype=torch.float64)
        torch.testing.assert_close(linear(e, "down_proj", h), h @ down[e] + down_bias[e])
    assert torch.equal(state["model.norm.weight"], torch.ones(hidden))
    assert not any(name.endswith(("gate_up_proj", "down_proj", "_bias")) for name in state)
