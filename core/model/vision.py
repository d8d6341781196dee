"""Building blocks of vision model plugins: transformers' vision towers run as they are
(``hf_module``), 3-D rotary positions (``MRotaryEmbedding``, Qwen2-VL's M-RoPE), and the API
side: reading images (``read_image``) and transformers' processor of a checkpoint
(``HFImageProcessor``), which sizes, tiles and expands images exactly as the checkpoint's own
processor does because it is that processor.

The image processors are transformers' PIL-based ones (``AutoImageProcessor`` picks them
where torchvision is absent); a processor class that also holds a video processor (which
needs torchvision) is built without one, as images are all it processes here.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from tessellm.core.errors import InvalidRequestError, ModelLoadError
from tessellm.core.interfaces.multimodal import ImageInput, ImageProcessor, ProcessedPrompt, content_key
from tessellm.core.model.decoder import RotaryEmbedding

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""The image formats a prompt's images may come in (PIL's names)."""


def hf_module(make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` (a transformers module, e.g. a vision tower from its config) with its
    parameters on the meta device, to be loaded from the checkpoint by name, and its buffers
    (rotary tables, position ids: not in checkpoints) computed on the CPU; the model plugin
    moves them to the device after loading (``to_device``)."""
    from accelerate import init_empty_weights

    with torch.device("cpu"), init_empty_weights(include_buffers=False):
        return make()


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): positions [3, T] (temporal, height, width); the
    first ``section[0]`` rotary frequencies follow the temporal position, the next
    ``section[1]`` the height, the last the width, as transformers recomposes them. Given 1-D
    positions [T] (text: all three equal) it is the plain rotary embedding."""

    def __init__(self, spec: Any, section: tuple[int, ...], table: str = "default"):
        super().__init__(spec, table)
        self.section = list(section)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        freqs = positions.float()[..., None] * self.inv_freq.float()  # [3, T, D/2]
        freqs = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(self.section, dim=-1))], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


# ---------------------------------------------------------------------------- the API side


def data_url_bytes(url: str, where: str, field: str | None = None) -> bytes:
    """The bytes of a ``data:<type>;base64,<payload>`` URL; InvalidRequestError naming
    ``where`` (and the request ``field``) for a data: URL that is not base64, or whose payload
    is not valid base64."""
    head, _, payload = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64"):
        raise InvalidRequestError(f"{where}: a data: URL must be base64 (data:image/<format>;base64,...)", field=field)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{where}: the data: URL's payload is not valid base64", field=field) from None


def read_image(item: Any, index: int = 0) -> Any:
    """A prompt's image as an RGB-convertible PIL image, from a PIL image, a path (str or
    Path) or the file's bytes; InvalidRequestError (field ``images``) naming image
    ``index`` and what is wrong: unreadable, or a format outside ``IMAGE_FORMATS``."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        return item
    where = f"image {index}"
    if isinstance(item, (str, Path)):
        path = Path(item).expanduser()
        if not path.is_file():
            raise InvalidRequestError(f"{where}: no such file {str(item)!r}", field="images")
        data = path.read_bytes()
    elif isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
    else:
        raise InvalidRequestError(f"{where} is a {type(item).__name__}; give a PIL image, a path or the file's bytes",
                                  field="images")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except UnidentifiedImageError:
        raise InvalidRequestError(f"{where} could not be read: it is not an image in a known format (supported: "
                                  f"{', '.join(IMAGE_FORMATS)})", field="images") from None
    except (OSError, ValueError, SyntaxError) as exc:  # a truncated or corrupt file
        raise InvalidRequestError(f"{where} could not be read: {exc}", field="images") from None
    if image.format not in IMAGE_FORMATS:
        raise InvalidRequestError(f"{where} is in format {image.format}, which is not supported; supported: "
                                  f"{', '.join(IMAGE_FORMATS)}", field="images")
    return image


def placeholder_runs(ids: list[int] | np.ndarray, token_id: int) -> list[tuple[int, int]]:
    """The runs of ``token_id`` in ``ids`` as (start, end), in order."""
    mask = np.asarray(ids) == token_id
    if not mask.any():
        return []
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.nonzero(edges == 1)[0].tolist(), np.nonzero(edges == -1)[0].tolist()))


def _without_video(cls: type) -> type:
    """``cls`` made to accept no video processor (which needs torchvision): images only."""
    if "video_processor" not in cls.get_attributes():
        return cls

    class ImagesOnly(cls):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = cls.__name__
    return ImagesOnly


def load_hf_processor(folder: Path, processor_cls: type) -> Any:
    """transformers' ``processor_cls`` for the checkpoint in ``folder``: its image processor
    (preprocessor_config.json, through AutoImageProcessor), tokenizer, chat template and
    processor options (processor_config.json), without a video processor."""
    from transformers import AutoImageProcessor, AutoTokenizer

    try:
        image_processor = AutoImageProcessor.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the image processor of {str(folder)!r}: {exc}".split("\n")[0]) from exc
    options: dict[str, Any] = {}
    config = folder / "processor_config.json"
    if config.is_file():
        options = json.loads(config.read_text())
    import inspect

    accepted = set(inspect.signature(processor_cls.__init__).parameters)
    options = {k: v for k, v in options.items() if k in accepted and k not in ("image_processor", "tokenizer")}
    options.setdefault("chat_template", getattr(tokenizer, "chat_template", None))
    parts = {"image_processor": image_processor, "tokenizer": tokenizer}
    if "video_processor" in processor_cls.get_attributes():
        parts["video_processor"] = None
    return _without_video(processor_cls)(**parts, **options)


class HFImageProcessor(ImageProcessor):
    """A checkpoint's transformers processor as an ``ImageProcessor``. A family says what its
    processor's outputs are per image: ``split(outputs, ids)`` -> per image (data, offset,
    length, placeholders), ``data`` that image's tensors alone."""

    def __init__(self, processor: Any, image_marker: str,
                 split: Callable[[dict[str, torch.Tensor], list[int]], list[tuple[dict, int, int, Any]]]):
        self.processor = processor
        self.image_marker = image_marker
        self.split = split

    def process(self, text: str, images: list[Any], add_special_tokens: bool = False) -> ProcessedPrompt:
        token = self.processor.image_token  # what the processor expands, one per image
        markers = text.count(token)
        if markers != len(images):
            raise InvalidRequestError(f"the prompt has {markers} image placeholder(s) ({token!r}; a chat template "
                                      f"writes {self.image_marker!r} for an image part) for {len(images)} image(s); "
                                      f"give one per image", field="images")
        if not images:
            ids = self.processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
            return ProcessedPrompt(list(ids), [])
        rgb = [image if image.mode == "RGB" else image.convert("RGB") for image in images]
        try:
            out = self.processor(text=[text], images=[rgb], return_tensors="pt",
                                 add_special_tokens=add_special_tokens)
        except (ValueError, TypeError, OSError) as exc:
            raise InvalidRequestError(f"the images could not be processed: {exc}".split("\n")[0],
                                      field="images") from None
        ids = out["input_ids"][0].tolist()
        parts = self.split(dict(out), ids)
        if len(parts) != len(images):
            raise InvalidRequestError(f"the processor placed {len(parts)} image(s) for {len(images)} given; check the "
                                      f"prompt's placeholders ({self.image_marker!r})", field="images")
        inputs = [ImageInput(offset, length, content_key(data), data, placeholders)
                  for data, offset, length, placeholders in parts]
        return ProcessedPrompt(ids, inputs)
