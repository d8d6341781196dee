"""The engine's side of images: admitting a prompt's images (``admit_images``), and before
each step the encoder step (``ImageEncoder.prepare``): every image a scheduled query reaches
gets its embeddings, from the encoder cache (recent images by content key) or from the model
plugin's encoder, all the step's misses in one call.

A request whose image the encoder fails on fails alone (its images are encoded again one
request at a time to find it), as a request whose forward raises does.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch

from tessellm.core.errors import InvalidRequestError, RequestRejectedError
from tessellm.core.interfaces.batch import ScheduledSeq
from tessellm.core.interfaces.multimodal import ImageInput, MultimodalPrompt
from tessellm.core.interfaces.sequence import Sequence, cut_chunk
from tessellm.core.interfaces.spec import ModelSpec


class EncoderCache:
    """Recent images' embeddings by content key, least recently used first out once they hold
    more than ``max_tokens`` embeddings in all (0: keep none beyond the step). An entry a
    live sequence still holds stays in memory through the sequence whatever the cache
    evicts; the cache only decides what a later request may reuse."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.tokens = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        embeds = self.entries.get(key)
        if embeds is not None:
            self.entries.move_to_end(key)
        return embeds

    def put(self, key: bytes, embeds: torch.Tensor) -> None:
        if key in self.entries or embeds.shape[0] > self.max_tokens:
            return
        self.entries[key] = embeds
        self.tokens += embeds.shape[0]
        while self.tokens > self.max_tokens:
            _, dropped = self.entries.popitem(last=False)
            self.tokens -= dropped.shape[0]

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0


def admit_images(spec: ModelSpec, model: Any, prompt: list[int], images: list[ImageInput], *, limit: int,
                 step_tokens: int | None) -> MultimodalPrompt:
    """A prompt's images checked against the prompt and the model (InvalidRequestError or
    RequestRejectedError naming the problem, field ``images``), with an M-RoPE model's
    positions computed."""
    vision = spec.vision
    if vision is None:
        raise InvalidRequestError(f"model {spec.model_type!r} is a text-only model: it takes no images; send the "
                                  f"prompt without them", field="images")
    if len(images) > limit:
        raise InvalidRequestError(f"{len(images)} images in one prompt; this pipeline takes at most {limit} "
                                  f"(max_images_per_prompt, tessellm serve --limit-mm-per-prompt image={limit})",
                                  field="images")
    previous_end = 0
    ids = np.asarray(prompt, dtype=np.int64)
    for i, image in enumerate(images):
        if not isinstance(image, ImageInput):
            raise InvalidRequestError(f"image {i} is a {type(image).__name__}, not a processed ImageInput (give "
                                      f"images to LLM.generate, which processes them)", field="images")
        if image.offset < previous_end or image.end > len(prompt) or image.length <= 0:
            raise InvalidRequestError(f"image {i}'s span [{image.offset}, {image.end}) is not inside the prompt of "
                                      f"{len(prompt)} tokens after the image before it", field="images")
        at = image.embed_positions()
        if at.size == 0 or (ids[at] != vision.image_token_id).any():
            raise InvalidRequestError(f"image {i}'s placeholder positions do not hold the model's image token "
                                      f"{vision.image_token_id}", field="images")
        if vision.whole_images and step_tokens is not None and image.length > step_tokens:
            raise RequestRejectedError(f"image {i} takes {image.length} tokens, which must run in one step, but a step "
                                       f"holds at most {step_tokens} tokens (the scheduler's max_num_batched_tokens); "
                                       f"raise it or send a smaller image", field="images")
        previous_end = image.end
    rope = model.rope_positions(list(prompt), images) if vision.mrope_section is not None else None
    mm = MultimodalPrompt(tuple(images), whole_images=vision.whole_images)
    if rope is not None:
        mm.rope_positions, mm.rope_delta = rope
    return mm


def images_salt(salt: str | None, images: tuple[ImageInput, ...]) -> str:
    """``salt`` with the images' keys folded in: what keys a prompt's blocks in a cache plugin
    written before plugin API 1.19, which does not read ``Sequence.images`` (only prompts
    with the same images, in the same places, share blocks there)."""
    h = hashlib.blake2b(digest_size=16)
    for image in images:
        h.update(image.key + image.offset.to_bytes(8, "little"))
    return f"{salt or ''}\x1fimages:{h.hexdigest()}"


class ImageEncoder:
    """The encoder step: attaches to each scheduled sequence the embeddings of the images its
    query reaches (``MultimodalPrompt.embeds``), from ``cache`` or ``encode`` (the model's
    ``encode_images``); counts them in ``stats`` (``images_encoded``, ``encoder_cache_hits``,
    ``encoder_seconds``)."""

    def __init__(self, encode: Callable[[list[ImageInput]], list[torch.Tensor]], hidden_size: int,
                 cache: EncoderCache, stats: Any):
        self.encode = encode
        self.hidden_size = hidden_size
        self.cache = cache
        self.stats = stats

    def prepare(self, scheduled: list[ScheduledSeq], scheduler_name: str) -> dict[str, BaseException]:
        """Attach what the step's queries need; the requests that cannot run, with why
        (their image failed to encode, or the scheduler cut one of their images in two)."""
        failed: dict[str, BaseException] = {}
        wanted: dict[bytes, list[tuple[Sequence, int]]] = {}
        for item in scheduled:
            seq, mm = item.seq, item.seq.multimodal
            if mm is None:
                continue
            start = seq.num_computed_tokens
            end = start + item.num_query_tokens
            for j, image in enumerate(mm.images):
                if image.end <= start:
                    mm.embeds.pop(j, None)  # computed: the step no longer needs it
                elif image.offset < end and j not in mm.embeds:
                    wanted.setdefault(image.key, []).append((seq, j))
            if cut_chunk(seq, start, item.num_query_tokens) != item.num_query_tokens:
                failed[seq.request_id] = RuntimeError(
                    f"scheduler plugin {scheduler_name!r} cut a prefill chunk inside an image that must be computed "
                    f"whole (positions {start}..{end}); a scheduler must cut chunks with cut_chunk (plugin API 1.19)")
        missing = []
        for key, users in wanted.items():
            embeds = self.cache.get(key)
            if embeds is None:
                missing.append(key)
                continue
            self.stats.encoder_cache_hits += 1
            for seq, j in users:
                seq.multimodal.embeds[j] = embeds
        if missing:
            failed.update(self._encode(missing, wanted))
        return failed

    def _encode(self, keys: list[bytes], wanted: dict[bytes, list[tuple[Sequence, int]]]
                ) -> dict[str, BaseException]:
        """Encode the images ``keys`` name in one call; if that raises, one at a time, failing
        the requests of the images that raise alone."""
        images = [seq.images[j] for seq, j in (wanted[k][0] for k in keys)]
        start = time.perf_counter()
        try:
            results: list[Any] = list(self._checked(images))
        except Exception:
            results = []
            for image in images:
                try:
                    results.append(self._checked([image])[0])
                except Exception as exc:
                    results.append(exc)
        self.stats.encoder_seconds += time.perf_counter() - start
        failed: dict[str, BaseException] = {}
        for key, result in zip(keys, results):
            for seq, j in wanted[key]:
                if isinstance(result, BaseException):
                    failed[seq.request_id] = result
                else:
                    seq.multimodal.embeds[j] = result
            if not isinstance(result, BaseException):
                self.stats.images_encoded += 1
                self.cache.put(key, result)
        return failed

    def _checked(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """The encoder's embeddings of ``images``, each [num_embeds, hidden] (else an error
        naming the image's placeholder count)."""
        out = self.encode(images)
        if len(out) != len(images):
            raise RuntimeError(f"the model's encode_images returned {len(out)} embeddings for {len(images)} images")
        for image, embeds in zip(images, out):
            if tuple(embeds.shape) != (image.num_embeds, self.hidden_size):
                raise RuntimeError(f"the model's encoder gave embeddings of shape {tuple(embeds.shape)} for an image "
                                   f"with {image.num_embeds} placeholder tokens (hidden size {self.hidden_size})")
        return out


def release_images(seq: Sequence) -> None:
    """Let go of a finished sequence's attached embeddings (its forks share them until they end)."""
    if seq.multimodal is not None:
        seq.multimodal.embeds.clear()
