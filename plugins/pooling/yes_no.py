"""Pooler `yes-no`: a decoder reranker's relevance, the probability that the model answers
"yes" rather than "no" after a (query, document) prompt (Qwen3-Reranker; sentence-transformers'
LogitScore with a sigmoid): sigmoid(logit_yes - logit_no) at the prompt's last token, from
two rows of the LM head. A pair is laid out as Qwen3-Reranker's model card does: a system
prefix, ``<Instruct>: ... <Query>: ... <Document>: ...`` and an assistant suffix, each part
tokenized on its own; the options change any part (another reranker's template)."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

import tessellm
from tessellm.core.errors import ConfigError
from tessellm.core.interfaces.pooling import Pooler, PoolingContext, PoolingParams
from tessellm.core.plugin import PluginOptions

QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


class YesNoOptions(PluginOptions):
    """Options of the `yes-no` pooler."""

    yes_token: str = Field("yes", min_length=1)
    """The answer that means relevant (one token of the vocabulary)."""
    no_token: str = Field("no", min_length=1)
    """The answer that means not relevant (one token)."""
    instruction: str = "Given a web search query, retrieve relevant passages that answer the query"
    """What the ``{instruction}`` of ``body`` says."""
    prefix: str = QWEN3_PREFIX
    """Text before each pair (tokenized alone, no special tokens added)."""
    body: str = QWEN3_BODY
    """The pair, with ``{instruction}``, ``{query}`` and ``{document}`` filled in."""
    suffix: str = QWEN3_SUFFIX
    """Text after each pair, ending where the model answers."""


class YesNoPooler(Pooler):
    """sigmoid(logit_yes - logit_no) at the last token: a decoder reranker's P(yes)."""

    name = "yes-no"
    api_version = "1.19"
    description = "scores: P(yes) over yes/no at the last token (decoder rerankers: Qwen3-Reranker)"
    Options = YesNoOptions
    task = "score"
    uses_lm_head = True
    rows = "last"

    def __init__(self, options: YesNoOptions, ctx: PoolingContext):
        super().__init__(options, ctx)
        if ctx.lm_head_rows is None:
            raise ConfigError(f"pooling.name: 'yes-no' reads the LM head, and this {ctx.model.model_type!r} model "
                              f"has none; serve the reranker's causal-LM checkpoint")
        ids = []
        for field in ("yes_token", "no_token"):
            token = getattr(options, field)
            token_id = ctx.token_id(token)
            if token_id is None:
                raise ConfigError(f"pooling.options.{field}: {token!r} is not one token of this tokenizer; give "
                                  f"a word the vocabulary holds whole")
            ids.append(token_id)
        for part in ("{instruction}", "{query}", "{document}"):
            if part not in options.body:
                raise ConfigError(f"pooling.options.body must hold {part}; it is {options.body!r}")
        self.answers = ctx.lm_head_rows(ids).detach()  # [2, hidden]: yes, no

    @property
    def width(self) -> int:
        return 1

    def pool(self, hidden: list[torch.Tensor], params: list[PoolingParams]) -> list[torch.Tensor]:
        last = torch.stack([rows[-1] for rows in hidden])  # [B, hidden]
        logits = (last @ self.answers.to(last.dtype).T).float()  # [B, 2]
        odds = logits[:, 0] - logits[:, 1]
        return [(torch.sigmoid(x) if p.use_activation is not False else x)[None] for x, p in zip(odds, params)]

    def encode_pair(self, tokenizer: Any, query: str, document: str,
                    max_length: int | None = None) -> tuple[list[int], list[int] | None]:
        """The template's three parts, each tokenized alone; ``max_length`` cuts the middle
        one's end, so the prefix and the suffix (where the model answers) stay whole."""
        o = self.options
        body = o.body.format(instruction=o.instruction, query=query, document=document)
        prefix, middle, suffix = (tokenizer(text, add_special_tokens=False)["input_ids"]
                                  for text in (o.prefix, body, o.suffix))
        if max_length is not None:
            middle = middle[:max(max_length - len(prefix) - len(suffix), 0)]
        return [*prefix, *middle, *suffix], None


@tessellm.hookimpl
def register_pooling(register):
    register(YesNoPooler)
