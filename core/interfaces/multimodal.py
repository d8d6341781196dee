"""Images in a prompt (plugin API 1.19): what one processed image is (``ImageInput``), how
images are keyed by content, what a step's batch carries for them (``MultimodalBatch``), and
the two parts a vision model plugin provides: the processor that runs where prompts are
tokenized (``ImageProcessor``) and the encoder its module runs in the engine
(``VisionModule``).

An image is part of its prompt. The processor (transformers' own, for the checkpoint) turns
the prompt's text and images into token ids in which each image is a run of placeholder
tokens, sized as the checkpoint's processor sizes it (resizing, tiling), and into the
tensors the vision encoder reads. The engine encodes each image once (its encoder cache
keeps recent images' embeddings by content key) and writes the embeddings over the
placeholders' input embeddings before the decoder runs. Prefix caching keys a block by
the images it overlaps (``images_key``): the placeholder ids of two images are the same, so
the block key must hold the images' content.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence as Seq

import numpy as np
import torch


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt, processed.

    ``offset``/``length``: the span of prompt positions the image occupies, from its first
    placeholder token to its last (a tiled image's span holds its tiles' separator tokens
    too). ``placeholders``: the positions within the span that take the image's embeddings,
    in order (None: every position of the span). ``key``: a 128-bit digest of ``data``
    (``content_key``): equal keys, equal images as the encoder sees them. ``data``: the
    processor's tensors for this image alone (e.g. ``pixel_values``, ``image_grid_thw``),
    on the CPU, what the model plugin's encoder reads.

    Example: a Qwen2.5-VL prompt ``[t, t, <start>, <pad> x 4, <end>, t]`` has one image with
    offset 3, length 4, placeholders None: the encoder's 4 embeddings replace positions 3-6."""

    offset: int
    length: int
    key: bytes
    data: dict[str, torch.Tensor] = field(repr=False)
    placeholders: tuple[int, ...] | None = None

    @property
    def end(self) -> int:
        """The position after the image's span."""
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """How many embeddings the encoder gives for this image (its placeholder tokens)."""
        return self.length if self.placeholders is None else len(self.placeholders)

    def embed_positions(self) -> np.ndarray:
        """The prompt positions of its placeholders, in embedding order [num_embeds] int64."""
        if self.placeholders is None:
            return np.arange(self.offset, self.end, dtype=np.int64)
        return self.offset + np.asarray(self.placeholders, dtype=np.int64)


def content_key(data: dict[str, torch.Tensor]) -> bytes:
    """A 128-bit blake2b digest of an image's processed tensors (names, dtypes, shapes and
    bytes): what the encoder cache and the prefix cache key the image by."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"tessellm-image-v1")
    for name in sorted(data):
        tensor = data[name].detach().cpu().contiguous()
        h.update(f"\x1f{name}:{tensor.dtype}:{tuple(tensor.shape)}\x1f".encode())
        raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
        h.update(raw.numpy().tobytes())
    return h.digest()


def images_key(images: Seq[ImageInput], start: int, end: int) -> bytes:
    """What the images overlapping positions [start, end) add to that range's prefix-cache
    key: each one's content key and its offset relative to ``start`` (b"" when none
    overlaps). A cache plugin folds it into the key of the block covering the range, so a
    block holding part of an image is shared only with prompts holding the same image
    there (plugin API 1.19)."""
    parts = [image.key + (image.offset - start).to_bytes(8, "little", signed=True)
             for image in images if image.offset < end and image.end > start]
    return b"".join(parts)


@dataclass
class MultimodalPrompt:
    """What the engine keeps of a prompt's images (``Sequence.multimodal``): the images, in
    prompt order; for a model with 3-D rotary positions (M-RoPE), each prompt position's
    ``rope_positions`` [3, prompt_len] and the ``rope_delta`` every generated position is
    shifted by; whether an image's tokens are computed in one step; and the embeddings the
    engine has attached for the images a step needs (index -> [num_embeds, hidden] on the
    model's device), dropped once the prompt is computed past them."""

    images: tuple[ImageInput, ...]
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0
    whole_images: bool = False
    """Whether each image's tokens must be computed in one step (``VisionSpec.whole_images``)."""
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_image_tokens(self) -> int:
        return sum(image.length for image in self.images)


@dataclass
class MultimodalBatch:
    """A step's image inputs (``BatchMetadata.images``; None when no scheduled sequence has
    images): ``rows`` [N] int64, the packed rows whose input embedding is an image's, and
    ``embeds`` [N, hidden] those embeddings (the model's dtype, on its device); ``positions``
    [3, T] int64, every row's 3-D rotary position for an M-RoPE model when some row lies in
    a prompt with images (None: ``BatchMetadata.positions``); ``spans``: (sequence index in
    the batch, first position, end) of each image a sequence's query reaches, for attention
    that is bidirectional within an image (``VisionSpec.whole_images``)."""

    rows: torch.Tensor
    embeds: torch.Tensor
    positions: torch.Tensor | None = None
    spans: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class ProcessedPrompt:
    """A prompt's token ids with its images' placeholders expanded, and the images."""

    token_ids: list[int]
    images: list[ImageInput]


class ImageProcessor(ABC):
    """The API side of a vision model (``ModelArchitecture.image_processor``): runs where
    prompts are tokenized (the ``LLM``'s thread, the server's API process), never in the
    engine's step.

    ``image_marker``: the text a prompt holds where an image goes (what the chat template
    writes for an image part, e.g. ``<|vision_start|><|image_pad|><|vision_end|>``);
    ``process(text, images)`` expands each marker as the checkpoint's own processor does
    (resizing, tiling, placeholder runs) and returns the token ids and the images, keyed."""

    image_marker: str = ""

    @abstractmethod
    def process(self, text: str, images: list[Any], add_special_tokens: bool = False) -> ProcessedPrompt:
        """``text`` (a rendered prompt with one ``image_marker`` per image) and ``images``
        (PIL images, in order) -> token ids (with the tokenizer's BOS where
        ``add_special_tokens``: a raw prompt, not a rendered chat) and ``ImageInput``s;
        InvalidRequestError when they do not match."""


class VisionModule(Protocol):
    """What the module of a model whose spec has ``vision`` implements besides the decoder's
    forward (which takes a ``MultimodalBatch`` as ``images``)."""

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's embeddings [num_embeds, hidden], in the model's dtype on its device:
        the vision encoder and projector over ``image.data`` (several images in one call)."""

    def rope_positions(self, prompt: list[int], images: Seq[ImageInput]) -> tuple[np.ndarray, int] | None:
        """For an M-RoPE model: every prompt position's 3-D rotary position [3, len(prompt)]
        and the shift of the positions after the prompt; None for a model with 1-D RoPE."""
