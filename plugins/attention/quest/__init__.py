"""Attention `quest`: QUEST query-aware sparse decode attention (backend.py) over the paged
cache's per-block key bounds, with its scoring, selection and sparse attention in torch
(select.py)."""

import tessellm
from tessellm.plugins.attention.quest.backend import QuestAttention, QuestOptions, QuestPlan

__all__ = ["QuestAttention", "QuestOptions", "QuestPlan"]


@tessellm.hookimpl
def register_attention(register):
    register(QuestAttention)
