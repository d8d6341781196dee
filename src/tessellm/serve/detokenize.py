"""Detokenizing a request's streamed tokens incrementally, on the coroutine that reads them.

Each step decodes a window of a few tokens (the last ones already shown, as context, and
the new ones) instead of the whole output, so the work per step is proportional to the new
tokens, whatever the output's length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from tessellm.serve.engine_client import StepOutput


def direct_decode(tokenizer: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, as a function of ``ids``: for a
    transformers tokenizer backed by the ``tokenizers`` library whose ``decode`` adds nothing
    to the library's own (no clean-up of spaces, neither method overridden), the library is
    called directly, whose decode of a few tokens costs a fraction of transformers' wrapper
    around it (each streamed token is decoded twice)."""
    library = getattr(tokenizer, "_tokenizer", None)
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # an older transformers: no backend class to recognize
        TokenizersBackend = None  # noqa: N806
    plain = (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
             and type(tokenizer)._decode is TokenizersBackend._decode
             and type(tokenizer).decode is PreTrainedTokenizerBase.decode
             and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
             and callable(getattr(library, "decode", None)))
    if plain:
        return lambda ids: library.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Text deltas of a growing token list, decoding a short window at each call.

    The window holds the tokens from the prefix offset on; its first ``read`` tokens are
    text already emitted, kept as context (a SentencePiece token's leading space, say, is
    decoded as it is within the text). A call decodes the window with and without the new
    tokens and emits the difference; a text ending in U+FFFD (a UTF-8 character split across
    tokens) waits for the next token, unless ``final``. Each emission starts and ends on a
    character boundary, so for a tokenizer whose decoding of a sequence is the concatenation
    of its parts' (byte-level BPE, SentencePiece with byte fallback) the deltas add up to the
    decoding of the whole list. The window is a few tokens: it grows only while its text ends
    in an incomplete character, which valid UTF-8 completes within four bytes.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.window: list[int] = []
        self.read = 0

    def add(self, new_ids: list[int], final: bool = False) -> str:
        self.window.extend(new_ids)
        text = self.decode(self.window)
        before = self.decode(self.window[:self.read]) if self.read else ""
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.window = self.window[self.read:]  # the tokens just read become the next prefix
        self.read = len(self.window)
        return text[len(before):]


class SampleText:
    """One sample's text as its reader sees it: the detokenizer's stable text, less a tail
    that could still turn into a stop string (``hold`` characters: the longest stop string's
    length less one), and on the final delta the rest, cut where the engine's stop rule found
    a stop string (``stop_text_len``: where it begins in the text of the whole output)."""

    def __init__(self, decode: Callable[[list[int]], str], hold: int):
        self.detokenizer = IncrementalDetokenizer(decode)
        self.hold = hold
        self.shown = 0  # characters handed out
        self.pending = ""  # decoded, held back

    def push(self, token_ids: list[int], final: bool, stop_text_len: int | None) -> str:
        self.pending += self.detokenizer.add(token_ids, final)
        if not final:
            end = max(len(self.pending) - self.hold, 0)
        elif stop_text_len is None:
            end = len(self.pending)
        else:
            end = max(stop_text_len - self.shown, 0)
        text, self.pending = self.pending[:end], self.pending[end:]
        self.shown += len(text)
        return text


class RequestText:
    """Fills in the ``text`` of a request's deltas as its coroutine reads them (a
    ``SampleText`` per sample)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode = decode
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.samples: dict[int, SampleText] = {}

    def fill(self, out: StepOutput) -> StepOutput:
        for d in out.samples:
            sample = self.samples.get(d.index)
            if sample is None:
                sample = self.samples[d.index] = SampleText(self.decode, self.hold)
            d.text = sample.push(d.token_ids, d.finish_reason is not None, d.stop_text_len)
        return out
