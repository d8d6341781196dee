"""LoRA adapters for tests, made with PEFT's own classes: ``build_tiny_lora`` gives a base
checkpoint folder a random adapter in PEFT's format; ``peft_greedy`` is transformers + PEFT's
greedy continuation under it, the reference tessellm's tokens are held to."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch


def build_tiny_lora(base: Path, target: Path, *, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                    target_modules: Sequence[str] = ("q_proj", "v_proj"), use_rslora: bool = False,
                    std: float = 0.2, **config: Any) -> Path:
    """A PEFT LoRA adapter for the model folder ``base``, saved in ``target``
    (adapter_config.json, adapter_model.safetensors): ``rank``, ``alpha`` and
    ``target_modules`` as PEFT takes them (``config``: any other ``peft.LoraConfig`` field,
    e.g. rank_pattern), with both A and B drawn from N(0, std) under ``seed`` (PEFT starts B at
    zero, an adapter that changes nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **config)
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    peft_model.save_pretrained(target, safe_serialization=True)
    return target


def peft_model(base: Path, adapter: Path | None, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model of ``base`` with PEFT's adapter ``adapter`` applied (None: the base
    model alone), in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).eval()
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).eval()


def peft_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt`` by ``model`` (``peft_model``), ``max_tokens`` long,
    one full forward per token (no cache: nothing but the model's own arithmetic)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]
