"""Attention implementations registered with transformers' ``AttentionInterface``, as a user registers a kernel of
their own (imported, they register themselves, in every rank that unpickles a module using them): one that keeps
packed documents apart from the ``position_ids`` alone, taking no mask (as FlashAttention's varlen path does), and one
that ignores the documents (plain causal attention: what a kernel without packed support computes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from lightning_hybrid.hf import CausalLM
from tests.families import tiny_config


def _documents(position_ids: torch.Tensor) -> torch.Tensor:
    return (position_ids == 0).cumsum(-1)


def per_document(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention within each document, the documents read from ``position_ids`` (a mask built here)."""
    positions = kwargs.get("position_ids")
    mask = None
    if positions is not None:
        docs, n = _documents(positions), query.size(-2)
        mask = ((docs[:, :, None] == docs[:, None, :])
                & torch.ones(n, n, dtype=torch.bool, device=query.device).tril())[:, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                         dropout_p=dropout, enable_gqa=key.size(1) != query.size(1))
    return out.transpose(1, 2).contiguous(), None


def leaky(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention over the whole row: packed documents see each other."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, dropout_p=dropout,
                                         enable_gqa=key.size(1) != query.size(1))
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("user_per_document", per_document)
AttentionInterface.register("user_leaky", leaky)


def user_attention_lm(family: str, implementation: str = "user_per_document", lr: float = 2e-4) -> CausalLM:
    """A tiny transformers model of ``family`` running ``implementation``."""
    return CausalLM(tiny_config(family), lr=lr, attn_implementation=implementation)
