"""What the planner reads of a Hugging Face config: the config itself without a download (`hf_config`), its
family's conventions (biases, plain or gated MLPs, learned positions, q/k norms), its experts (`hf_experts`) and
attention windows (`hf_windows`), the parameter count transformers builds (`hf_parameter_count`) and what the
planner does not model of it (`hf_notes`). `lightning_hybrid.planner.model.ModelSpec.from_hf` builds on these."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

__all__ = ["BIAS_FAMILIES", "FOUR_NORM_FAMILIES", "LEARNED_POSITIONS", "PLAIN_MLP_FAMILIES", "QK_NORMS", "hf_config",
           "hf_experts", "hf_notes", "hf_parameter_count", "hf_windows"]


def hf_experts(config: Any, n_layer: int) -> dict[str, int]:
    """The MoE fields of a Hugging Face config (empty for a dense model): experts (``num_local_experts`` Mixtral,
    GPT-OSS; ``num_experts`` Qwen2/3-MoE, OLMoE; ``n_routed_experts`` DeepSeek), ``num_experts_per_tok``, the
    expert width (``moe_intermediate_size``, else ``intermediate_size``), the shared experts' (Qwen2-MoE's
    ``shared_expert_intermediate_size``; DeepSeek's ``n_shared_experts`` -- ``num_shared_experts``,
    ``moe_num_shared_experts`` in other families -- times the expert width; Llama 4's one shared expert, always there)
    and how many layers are MoE (DeepSeek's ``first_k_dense_replace`` dense first; Llama 4's ``moe_layers`` list;
    ERNIE 4.5's ``moe_layer_start_index`` to ``moe_layer_end_index`` every ``moe_layer_interval``; Qwen's
    ``decoder_sparse_step`` and ``mlp_only_layers``)."""
    def get(name: str) -> Any:
        return getattr(config, name, None)

    experts = next((int(get(n)) for n in ("num_local_experts", "num_experts", "n_routed_experts") if get(n)), 0)
    if not experts:
        return {}
    if get("first_k_dense_replace") is not None:
        moe_layers = n_layer - int(get("first_k_dense_replace"))
    elif isinstance(get("moe_layers"), (list, tuple)):  # Llama 4: the MoE layers' indices
        moe_layers = len(get("moe_layers"))
    elif get("moe_layer_start_index") is not None:  # ERNIE 4.5: every interval-th layer from start to end
        start, interval = int(get("moe_layer_start_index")), int(get("moe_layer_interval") or 1)
        end = int(get("moe_layer_end_index") if get("moe_layer_end_index") is not None else n_layer - 1)
        moe_layers = sum(1 for i in range(n_layer) if start <= i <= end and (i + 1) % interval == 0)
    else:
        step, dense = int(get("decoder_sparse_step") or 1), set(get("mlp_only_layers") or ())
        moe_layers = sum(1 for i in range(n_layer) if i not in dense and (i + 1) % step == 0)
    if moe_layers <= 0:
        return {}
    expert_ffn = int(get("moe_intermediate_size") or get("intermediate_size"))
    copies = next((get(n) for n in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
                   if isinstance(get(n), int)), 0)
    if str(get("model_type")) in ("llama4_text", "llama4"):  # Llama4TextMoe: one shared expert of the expert width
        copies = 1
    shared = int(get("shared_expert_intermediate_size") or 0) or int(copies) * expert_ffn
    top_k = int(get("num_experts_per_tok") or get("moe_top_k") or 1)
    return {"experts": experts, "top_k": top_k, "expert_ffn": expert_ffn, "moe_layers": moe_layers,
            "shared_ffn": shared}


#: Families whose MLP is two matrices (up, down) with a plain activation; every other family's is gated (three:
#: gate, up, down -- SwiGLU, GeGLU), as Llama's.
PLAIN_MLP_FAMILIES = frozenset({"gpt2", "gpt_neox", "gptj", "gpt_neo", "gpt_bigcode", "opt", "bloom", "falcon", "phi",
                                "starcoder2", "codegen", "mpt", "biogpt", "xglm"})
#: Families with biases on every Linear and LayerNorm (GPT-2 style).
BIAS_FAMILIES = frozenset({"gpt2", "gpt_neox", "gpt_bigcode", "opt", "bloom", "phi", "starcoder2"})
#: Families with a learned position table, and the config field of its rows.
LEARNED_POSITIONS = {"gpt2": "n_positions", "gpt_bigcode": "n_positions"}
#: Families with q/k norms: one of ``head_dim`` each (``"head"``), or over all heads (``"all"``: ``a d``, ``a_kv d``).
QK_NORMS = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "olmoe": "all", "olmo2": "all"}
#: Families with four norms per block (pre and post attention and MLP) instead of two.
FOUR_NORM_FAMILIES = frozenset({"gemma2", "gemma3_text"})


def hf_config(source: Any, overrides: Optional[dict[str, Any]] = None) -> Any:
    """A ``transformers`` config without a download: ``source`` a local folder (its ``config.json``), a
    ``config.json`` file, a model type (``"llama"``: transformers' own defaults) or a ``PretrainedConfig``;
    ``overrides`` given to the config's constructor, so that what it derives follows them (Llama's ``head_dim``
    from ``hidden_size``), a field the class does not know refused -- as `lightning_hybrid.hf.CausalLM` reads its
    ``model`` and ``config``."""
    from transformers import PretrainedConfig

    from lightning_hybrid.hf.config import _resolve_config

    if isinstance(source, PretrainedConfig):
        source = {"model_type": source.model_type, **source.to_dict()}
    elif not isinstance(source, dict):
        path = Path(str(source))
        if path.is_file():
            source = str(path.parent) if path.name == "config.json" else json.loads(path.read_text())
        else:
            source = str(source)
    return _resolve_config(source, dict(overrides or {}))


def hf_parameter_count(config: Any) -> int:
    """The parameters of ``AutoModelForCausalLM.from_config(config)``, built on the meta device (no memory, no
    download; DeepSeek-V3's 671B in about a second), shared tensors once."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def hf_windows(config: Any, n_layer: int) -> dict[str, int]:
    """Sliding-window attention a config declares (empty without one): ``sliding_window`` tokens, unless
    ``use_sliding_window`` is False (Qwen2's default), in the layers ``layer_types`` names ``sliding_attention``
    (Gemma 2/3, GPT-OSS, Qwen2's ``max_window_layers``), every layer where the config has no ``layer_types``
    (Mistral, Mixtral)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(config, "use_sliding_window", True) is False:
        return {}
    layer_types = list(getattr(config, "layer_types", None) or [])
    layers = sum(1 for t in layer_types if "sliding" in str(t)) if layer_types else n_layer
    return {"window": window, "window_layers": min(layers, n_layer)} if layers else {}


def hf_notes(config: Any, spec: Any) -> list[str]:
    """What the planner does not model of ``config`` (described as ``spec``), or models only in part, one line each:
    sliding-window attention (its FLOPs follow the cluster's kernel; memory as without it), MLA's attention shapes
    (activations and attention FLOPs as ``a`` heads of ``qk_nope_head_dim + qk_rope_head_dim``), heads whose width is
    not ``h / a`` (activation coefficients per unit of ``h``), a learned position table shorter than ``seq_len``."""
    notes = []
    if spec.attention_span() < 1:
        notes.append(f"sliding-window attention ({spec.window} tokens, {spec.window_layers} of {spec.n_layer} layers):"
                     f" {spec.attention_span():.3f} of causal attention's keys at {spec.seq_len} tokens -- its FLOPs"
                     " where the cluster's attention kernel skips what the window masks (--window-kernels), the"
                     " whole causal attention's where it computes every key under a mask (this codebase's SDPA);"
                     " activation memory as without the window.")
    if getattr(config, "kv_lora_rank", None):
        notes.append(f"multi-head latent attention (MLA): parameters exact; activations, attention FLOPs and the"
                     f" context-parallel K/V exchange modelled as {spec.heads} heads of {spec.head_dim}"
                     " (qk_nope_head_dim + qk_rope_head_dim), not MLA's compressed latents (an approximation).")
    elif spec.head_size and spec.heads * spec.head_size != spec.hidden:
        notes.append(f"heads of {spec.head_size}: {spec.heads} x {spec.head_size} = {spec.heads * spec.head_size}"
                     f" != hidden {spec.hidden}; parameters, FLOPs of the projections and the K/V exchange use it,"
                     " the block's activation coefficients are per unit of hidden (an approximation).")
    if spec.learned_positions and spec.positions and spec.seq_len > spec.positions:
        notes.append(f"seq_len {spec.seq_len} > the learned position table's {spec.positions} rows: the model"
                     " cannot run at this length as it is.")
    return notes
