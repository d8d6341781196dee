"""The attention conformance suite on every built-in backend: sdpa, cascade, and flash (its
Triton kernels under the interpreter on a CPU, so with fewer, smaller cases) serve every
layer feature (windows per layer, softcaps, sinks) and are held to the float64 reference on
each; quest and mla serve none and must decline each, naming it."""

from __future__ import annotations

import torch

from tessellm.testing.conformance import AttentionConformance


class TestSdpa(AttentionConformance):
    plugin = "sdpa"
    max_examples = 12


class TestSdpaBatchedDecode(AttentionConformance):
    plugin = "sdpa"
    options = {"batch_decode": True}
    max_examples = 6


class TestCascade(AttentionConformance):
    plugin = "cascade"
    options = {"min_shared_tokens": 4}
    max_examples = 8
    block_size = 4  # shared leading blocks of 4 tokens: cascade's shared-prefix path runs


class TestFlash(AttentionConformance):
    plugin = "flash"
    max_examples = 3
    dtypes = (torch.float32,)  # bfloat16 under the interpreter adds minutes and no coverage a GPU run lacks


class TestQuest(AttentionConformance):
    """QUEST is exact where every context fits its token budget (the suite's contexts are at
    most 48 tokens, under the default 2048); its sparse cases are approximate by design and
    tested against the reference restricted to the chosen blocks in
    tests/plugins/attention/quest/."""

    plugin = "quest"
    options = {"dense_layers": 0}
    max_examples = 8


class TestMla(AttentionConformance):
    """Multi-head latent attention in its automatic form (absorbed decodes, naive the rest)."""

    plugin = "mla"
    max_examples = 8


class TestMlaAbsorbed(AttentionConformance):
    plugin = "mla"
    options = {"form": "absorbed"}
    max_examples = 4


class TestMlaTritonDecode(AttentionConformance):
    """The Triton decode kernel, interpreted on a CPU."""

    plugin = "mla"
    options = {"decode_kernel": "triton"}
    max_examples = 3
    dtypes = (torch.float32,)
