"""What a model's config says about its layers' attention, as context parallelism needs it: the sliding window or
attention chunks a layer keeps (`restricted_attention_of`) and the query heads per key/value head (`kv_group_of`)."""

from __future__ import annotations

from typing import Optional

from torch import nn

__all__ = ["kv_group_of", "restricted_attention_of"]


def restricted_attention_of(layer: nn.Module) -> tuple[Optional[int], Optional[int]]:
    """``(window, chunk)``: the sliding window a layer's attention keeps (a query sees the keys less than that many
    places before it) and the chunks it attends within (a query sees only the keys whose position // chunk is its
    own), as a ``transformers`` config says them -- ``sliding_window``, per layer ``layer_types[layer_idx] ==
    "sliding_attention"`` where the config lists them (Gemma, Cohere2, Qwen2 with ``use_sliding_window``), every
    layer otherwise (Mistral); ``attention_chunk_size`` for ``"chunked_attention"`` layers (Llama 4). ``None`` for
    what a layer does not declare (a model's own mask that says more is caught by the probe of the first step,
    `lightning_hybrid.checks.probe`)."""
    for sub in layer.modules():
        config, index = getattr(sub, "config", None), getattr(sub, "layer_idx", None)
        if config is None:
            continue
        types = getattr(config, "layer_types", None)
        kind = types[index] if types is not None and isinstance(index, int) and 0 <= index < len(types) else None
        window, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
        window = window if isinstance(window, int) and not isinstance(window, bool) else None
        chunk = chunk if isinstance(chunk, int) and not isinstance(chunk, bool) else None
        if window is None and chunk is None:
            continue
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        if types is not None:
            window = window if kind == "sliding_attention" else None
            chunk = chunk if kind == "chunked_attention" else None
        else:
            chunk = None
        return window, chunk
    return None, None


def kv_group_of(module: nn.Module) -> Optional[int]:
    """Query heads per key/value head as the module's config says: ``n_head / n_kv_head`` (the reference GPT's
    `GPTConfig`), ``num_attention_heads / num_key_value_heads`` (a transformers config: the module's ``config`` or
    ``hf_config``, as `lightning_hybrid.hf.CausalLM`'s, or its ``model``'s); None where none says."""
    model = getattr(module, "model", None)
    for config in (getattr(module, "config", None), getattr(module, "hf_config", None), getattr(model, "config", None)):
        for heads_name, kv_name in (("n_head", "n_kv_head"), ("num_attention_heads", "num_key_value_heads")):
            heads, kv = getattr(config, heads_name, None), getattr(config, kv_name, None)
            if isinstance(heads, int) and isinstance(kv, int) and 0 < kv <= heads and heads % kv == 0:
                return heads // kv
    return None
