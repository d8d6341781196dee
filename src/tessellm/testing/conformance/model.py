"""The model plugin contract as properties, checked against transformers: a model plugin
builds, for each Hugging Face model_type it declares, a module whose logits equal the
reference implementation's on tiny random checkpoints, and whose greedy tokens stay the
same through everything the engine does to a sequence (paged cache with prefix hits,
continuous batching with arrivals, chunked prefill, preemption, n-gram speculative decoding).

The reference is transformers' ``AutoModelForCausalLM`` on the same folder: a family
transformers ships, or one its author registered with transformers' Auto classes. The
checkpoints are built by ``build_checkpoint`` (transformers' own config and model classes by
default; override it where transformers lacks the family)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, strategies as st

from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.testing.conformance.base import ConformanceSuite, property_settings
from tessellm.testing.conformance.pipeline import registry_for, skip_unless_admitted


ANY_TYPE_FAMILIES = ("llama", "gemma2", "gpt_oss")
"""What a plugin that takes any model type (``any_model_type``) and declares none is checked
on, unless the suite names ``model_types``: plain attention, windows with softcaps, sinks
with MoE experts."""


class ModelConformance(ConformanceSuite):
    """The contract every model plugin honours, checked on the plugin named by ``plugin``
    (or ``plugin_class``), for each of ``model_types`` (default: every type it declares):

    - the spec describes the checkpoint (layers, vocabulary, hidden size, a KV shape) and
      the module takes every checkpoint tensor, none missing and none left over;
    - prefill logits in float64 equal the reference's within ``logits_tolerance``;
    - greedy tokens in float32 equal the reference's, alone and batched; a float32
      divergence passes only at a near-tie of the reference's two best logits;
    - the same tokens through the default pipeline: requests arriving while others run,
      prompts sharing a prefix run twice (the second time from the prefix cache), prefills
      in chunks in a cache small enough to preempt, and n-gram speculative decoding.

    The tiny checkpoint of a model type has transformers' default config for the type with
    every size field capped small (hidden size, layers, heads, intermediate sizes, positions,
    experts, ...: ``tessellm.testing.models.tiny_fields``), then the plugin's own
    ``tiny_config`` for the type, then the suite's ``shapes``. Shapes that would cost the
    suite more memory than its limit (``tessellm.testing.models.memory_limit``, 2 GiB) fail
    in one line before anything is allocated.

    Class attributes: ``shapes`` (model_type -> config fields for the tiny checkpoint; ``--check
    model:NAME --shapes JSON`` sets it), ``vocab_size``, ``logits_tolerance``, ``engine``
    (device and dtype pieces of the pipeline config); override ``build_checkpoint`` and
    ``reference_model`` where needed.
    """

    kind = "model"
    model_types: ClassVar[tuple[str, ...]] = ()
    shapes: ClassVar[dict[str, dict[str, Any]]] = {}
    vocab_size: ClassVar[int] = 512
    logits_tolerance: ClassVar[float] = 1e-5
    """float64 logits; transformers computes MoE routing weights and some rotary embeddings
    in float32 even in a float64 model, which costs it about 1e-6."""
    engine: ClassVar[dict[str, Any]] = {"device": "cpu"}
    new_tokens: ClassVar[int] = 10

    # ------------------------------------------------------------------ what authors override

    @classmethod
    def checkpoint_shapes(cls, model_type: str) -> dict[str, Any]:
        """The config fields the suite sets for ``model_type``'s tiny checkpoint: the plugin's
        ``tiny_config`` for it, then the suite's ``shapes``."""
        declared = getattr(cls.under_test(), "tiny_config", None) or {}
        return {**declared.get(model_type, {}), **cls.shapes.get(model_type, {})}

    @classmethod
    def build_checkpoint(cls, model_type: str, folder: Path) -> Path:
        """A tiny random checkpoint of ``model_type`` with a word-level tokenizer in
        ``folder`` (transformers' own classes, ``tessellm.testing.models.build_tiny``), of
        ``checkpoint_shapes``; one line (CheckpointTooLarge) where those would exceed the
        memory limit."""
        from tessellm.testing.models import build_tiny

        return build_tiny(model_type, folder, vocab_size=cls.vocab_size, **cls.checkpoint_shapes(model_type))

    @classmethod
    def reference_model(cls, folder: Path, dtype: torch.dtype) -> Any:
        """The reference implementation of the checkpoint in ``folder``, in ``dtype``."""
        from transformers import AutoModelForCausalLM

        try:  # transformers' MoE families need the eager experts in float64
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, experts_implementation="eager")
        except (TypeError, ValueError):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        return model.eval()

    # ------------------------------------------------------------------ fixtures

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "model_type" in metafunc.fixturenames:
            plugin = self.under_test()
            types = self.model_types or plugin.model_types or \
                (ANY_TYPE_FAMILIES if getattr(plugin, "any_model_type", False) else ())
            metafunc.parametrize("model_type", list(types), scope="class")

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, model_type: str, tmp_path_factory: pytest.TempPathFactory) -> "Checkpoint":
        """The tiny checkpoint of ``model_type`` and its reference models (built once)."""
        from tessellm.testing.models import CheckpointTooLarge

        try:
            folder = cls.build_checkpoint(model_type, tmp_path_factory.mktemp(f"model-{model_type}"))
        except CheckpointTooLarge as exc:
            pytest.fail(f"{cls.label()}: {exc}", pytrace=False)
        return Checkpoint(cls, model_type, folder)

    # ------------------------------------------------------------------ properties

    def test_spec_and_weights_describe_the_checkpoint(self, checkpoint: "Checkpoint") -> None:
        """The spec's shapes are the config's; every checkpoint tensor loads, none is left."""
        self.case()
        from tessellm.core.model.loader import checkpoint_state, load_hf_config, load_state_dict

        config = load_hf_config(checkpoint.folder)
        plugin = self.under_test()(self.plugin_options())
        spec = plugin.load_spec(config)
        assert (spec.num_layers, spec.vocab_size, spec.hidden_size) == (
            config.num_hidden_layers, config.vocab_size, config.hidden_size), "the spec's shapes are not the config's"
        assert spec.kv_shape.values_per_token > 0 and spec.architecture == plugin.name
        with torch.device("meta"):
            module = plugin.build(spec)
        expected = set(module.state_dict())
        names = set(checkpoint_state(plugin, load_state_dict(checkpoint.folder)))
        if spec.tie_word_embeddings:
            expected.discard("lm_head.weight")
            names.discard("lm_head.weight")
        assert not expected - names, f"parameters no checkpoint tensor fills: {sorted(expected - names)[:5]}"
        assert not names - expected, f"checkpoint tensors the module does not take: {sorted(names - expected)[:5]}"

    @given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, 40), min_size=1, max_size=3))
    @property_settings(max_examples=4)
    def test_prefill_logits_match_the_reference_in_float64(self, checkpoint: "Checkpoint", seed: int,
                                                           lengths: list[int]) -> None:
        """Teacher-forced logits of random prompts, every position, within the tolerance."""
        self.case()
        llm = checkpoint.llm("float64")
        reference = checkpoint.reference(torch.float64)
        for prompt in checkpoint.prompts(seed, lengths):
            ours = llm.engine.score(prompt).double()
            with torch.no_grad():
                theirs = reference(torch.tensor([prompt])).logits[0].double()
            error = (ours - theirs).abs().max().item()
            assert error <= self.logits_tolerance, (f"{checkpoint.model_type}: logits differ by {error:.3g} > "
                                                    f"{self.logits_tolerance:g} on a prompt of {len(prompt)} tokens")

    def test_greedy_tokens_match_the_reference(self, checkpoint: "Checkpoint") -> None:
        """float32, the reference plugins (contiguous cache, static batches), alone and batched."""
        self.case()
        prompts = checkpoint.prompts(11, [1, 7, 23, 40])
        llm = checkpoint.llm("float32", cache={"name": "contiguous", "options": {"max_seqs": 4}},
                             scheduler={"name": "static"})
        batched = llm.generate(prompts, checkpoint.params())
        checkpoint.assert_greedy(prompts, [o.token_ids for o in batched], "batched")
        alone = llm.generate(prompts[:1], checkpoint.params())
        checkpoint.assert_greedy(prompts[:1], [alone[0].token_ids], "alone")

    def test_arrivals_and_prefix_hits_keep_the_tokens(self, checkpoint: "Checkpoint") -> None:
        """Paged cache and continuous batching: requests join while others decode, and
        prompts sharing a prefix run twice, the second time reading it from the cache."""
        self.case()
        from tessellm.testing.engine import run_arrivals

        prompts = checkpoint.shared_prefix_prompts(12)
        llm = checkpoint.llm("float32", cache={"name": "paged", "options": {"block_size": 8}},
                             scheduler={"name": "continuous"})
        params = SamplingParams(max_tokens=self.new_tokens, ignore_eos=True, temperature=0.0)
        for _ in range(2):
            outputs = run_arrivals(llm.engine, [(2 * i, p, params) for i, p in enumerate(prompts)])
            checkpoint.assert_greedy(prompts, [outputs[f"r{i}"][0] for i in range(len(prompts))], "with arrivals")
        stats = llm.pipeline.cache.prefix_cache_stats()
        assert stats.hit_tokens > 0, "the second run read nothing from the prefix cache"

    def test_chunked_prefill_and_preemption_keep_the_tokens(self, checkpoint: "Checkpoint") -> None:
        """Prefills of 16 tokens a step, in a cache too small for every sequence at once."""
        self.case()
        prompts = checkpoint.shared_prefix_prompts(13)
        # the whole context kept on every layer: releasing out-of-window blocks would leave
        # room enough that nothing is preempted (the next property runs with it)
        llm = checkpoint.llm("float32", cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 12,
                                                                            "free_out_of_window": False}},
                             scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 16,
                                                                          "chunked_prefill": True}})
        outs = llm.generate(prompts, checkpoint.params(16))
        checkpoint.assert_greedy(prompts, [o.token_ids for o in outs], "chunked and preempted", 16)
        assert llm.engine.stats.preemptions > 0, "the cache was meant to be too small: nothing was preempted"
        assert llm.pipeline.cache.pool.num_used == 0, "finished requests left cache blocks referenced"

    def test_out_of_window_release_keeps_the_tokens(self, checkpoint: "Checkpoint") -> None:
        """A model with sliding-window layers: the paged cache releases, for those layers,
        the blocks every window has passed; tokens stay the reference's through chunked
        prefills, prefix hits (prompts sharing a prefix, run twice) and n-gram drafts rolled
        back."""
        self.case()
        if not checkpoint.windows():
            pytest.skip(f"{checkpoint.model_type} has no sliding-window layer: nothing is released")
        prompts = checkpoint.shared_prefix_prompts(16)
        llm = checkpoint.llm("float32", cache={"name": "paged", "options": {"block_size": 8, "num_blocks": 24}},
                             scheduler={"name": "continuous", "options": {"max_num_batched_tokens": 16,
                                                                          "chunked_prefill": True}},
                             decoding={"name": "speculative", "options": {"proposer": "ngram", "k": 3,
                                                                           "adaptive_k": False}})
        for run in ("released", "from the prefix cache"):
            outs = llm.generate(prompts, checkpoint.params(16))
            checkpoint.assert_greedy(prompts, [o.token_ids for o in outs], f"out-of-window blocks {run}", 16)
        cache = llm.pipeline.cache
        assert cache.released_blocks > 0, "no block was released though prompts outgrow every window"
        assert cache.prefix_cache_stats().hit_tokens > 0, "the second run read nothing from the prefix cache"

    def test_ngram_speculative_decoding_keeps_the_tokens(self, checkpoint: "Checkpoint") -> None:
        """Prompt-lookup drafts verified in one forward, rejected ones rolled back."""
        self.case()
        g = torch.Generator().manual_seed(14)
        motif = torch.randint(3, self.vocab_size, (6,), generator=g).tolist()
        prompts = [motif * 4, motif * 2 + [7, 8, 9], checkpoint.prompts(15, [9])[0]]
        llm = checkpoint.llm("float32", decoding={"name": "speculative", "options": {
            "proposer": "ngram", "k": 3, "adaptive_k": False}})
        outs = llm.generate(prompts, checkpoint.params(16))
        checkpoint.assert_greedy(prompts, [o.token_ids for o in outs], "speculative", 16)


class Checkpoint:
    """One tiny checkpoint under test: its folder, the pipelines and reference models built
    on it (each once), and the reference's greedy tokens (each prompt once)."""

    def __init__(self, suite: type[ModelConformance], model_type: str, folder: Path):
        self.suite, self.model_type, self.folder = suite, model_type, folder
        self._references: dict[torch.dtype, Any] = {}
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    def llm(self, dtype: str, **sections: Any) -> Any:
        """A pipeline on this checkpoint with the plugin under test as its architecture."""
        from tessellm import LLM
        from tessellm.core.engine.pipeline import Pipeline

        suite = self.suite
        part = {"name": suite.under_test().name, "options": dict(suite.options)}
        config = {"model": str(self.folder), **suite.engine, "dtype": dtype, "architecture": part, **sections}
        llm = LLM(pipeline=Pipeline.from_config(config, registry=registry_for(suite)))
        skip_unless_admitted(suite, llm, SamplingParams(**self.params()))  # the engine's rules for the suite's requests
        return llm

    def reference(self, dtype: torch.dtype) -> Any:
        if dtype not in self._references:
            self._references[dtype] = self.suite.reference_model(self.folder, dtype)
        return self._references[dtype]

    def windows(self) -> set[int]:
        """The sliding windows of the checkpoint's layers (empty: none slides)."""
        from tessellm.core.model.loader import load_hf_config

        spec = self.suite.under_test()(self.suite.plugin_options()).load_spec(load_hf_config(self.folder))
        return {spec.attention_of(i).sliding_window for i in range(spec.num_layers)} - {None}

    def prompts(self, seed: int, lengths: list[int]) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(3, self.suite.vocab_size, (n,), generator=g).tolist() for n in lengths]

    def shared_prefix_prompts(self, seed: int) -> list[list[int]]:
        """Four prompts sharing a 37-token prefix (four full blocks of 8 and a part)."""
        shared, *tails = self.prompts(seed, [37, 3, 9, 17, 1])
        return [shared + tail for tail in tails]

    def params(self, new: int | None = None) -> dict[str, Any]:
        return {"max_tokens": new or self.suite.new_tokens, "ignore_eos": True, "temperature": 0.0}

    def greedy(self, prompt: list[int], new: int) -> list[int]:
        """The float32 reference's argmax tokens (EOS included: ignore_eos keeps going)."""
        key = (*prompt, -new)
        if key not in self._greedy:
            ids, model = list(prompt), self.reference(torch.float32)
            with torch.no_grad():
                for _ in range(new):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            self._greedy[key] = ids[len(prompt):]
        return self._greedy[key]

    def assert_greedy(self, prompts: list[list[int]], outputs: list[list[int]], how: str, new: int | None = None) -> None:
        """Each output equals the reference's greedy tokens, or first differs from them at a
        near-tie of the reference's two best logits (float32 rounding may flip those)."""
        new = new or self.suite.new_tokens
        for prompt, ours in zip(prompts, outputs):
            theirs = self.greedy(prompt, new)
            if ours == theirs:
                continue
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            assert at < min(len(ours), len(theirs)), (f"{self.model_type} ({how}): {len(ours)} tokens, the "
                                                      f"reference {len(theirs)}")
            with torch.no_grad():
                logits = self.reference(torch.float32)(torch.tensor([prompt + theirs[:at]])).logits[0, -1]
            gap = (logits[theirs[at]] - logits[ours[at]]).abs().item()
            assert gap <= 1e-4 * max(1.0, logits.abs().max().item()), (
                f"{self.model_type} ({how}): token {at} of a {len(prompt)}-token prompt is {ours[at]}, the "
                f"reference's {theirs[at]} (its logits {gap:.3g} apart: not a near-tie); ours {ours}, "
                f"reference {theirs}")
