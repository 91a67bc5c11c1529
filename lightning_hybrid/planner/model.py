"""What the planner knows about a model: its shape, parameter counts and training FLOPs per token.

`ModelSpec` is a decoder-only transformer described by its sizes (``L`` layers, width ``h``, ``a`` query heads,
``a_kv`` key/value heads, MLP size ``F``, vocabulary ``V``, sequence length ``s``). It is built from a
`GPTConfig` (`ModelSpec.from_gpt`), a Hugging Face ``PretrainedConfig`` (`ModelSpec.from_hf`, no download),
an ``nn.Module`` (`ModelSpec.from_module`: its parameters counted, its sizes read from its config or its layers)
or a preset name (`MODEL_PRESETS`, `model_spec`).

Mixture of experts (``experts`` = ``E`` > 0): the last ``moe_layers`` blocks (default all; DeepSeek's dense first
layers) replace the MLP by ``E`` experts (MLPs of width ``expert_ffn`` = ``F_e``, gated like the dense MLP), a
router (``E x h``, replicated) sending each token to ``top_k`` = ``k`` of them, and shared experts that every token
visits (one MLP of their total width ``shared_ffn`` = ``F_s``; 0: none). ``params`` counts every expert;
`flops_per_token` only the ``k`` experts a token visits, the shared experts and the router (`active_params`).

The pipeline sees the model as ``embed, block_1 .. block_L, head`` (`pipeline_layer_params`), as the reference
GPT's ``layers()`` and `lightning_hybrid.hf.CausalLM` split it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from torch import nn

from .hf_configs import (
    BIAS_FAMILIES,
    FOUR_NORM_FAMILIES,
    LEARNED_POSITIONS,
    PLAIN_MLP_FAMILIES,
    QK_NORMS,
    hf_config,
    hf_experts,
    hf_notes,
    hf_parameter_count,
    hf_windows,
)

__all__ = ["BIAS_FAMILIES", "FOUR_NORM_FAMILIES", "LEARNED_POSITIONS", "MODEL_PRESETS", "MOE_FIELDS", "ModelSpec",
           "PLAIN_MLP_FAMILIES", "QK_NORMS", "hf_config", "hf_notes", "hf_parameter_count", "model_spec"]


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a decoder-only transformer.

    ``gated_mlp``: SwiGLU (three MLP matrices) instead of GELU (two); ``bias``: Linear/LayerNorm biases;
    ``learned_positions``: a ``seq_len x h`` position table (GPT-2 style) instead of rotary embeddings;
    ``tied_embeddings``: the LM head reuses the token embedding. ``params``: the parameter count, computed
    from the sizes unless given (a module's own count).

    Mixture of experts (all 0 for a dense model): ``experts`` per MoE layer, ``top_k`` of them per token,
    ``expert_ffn`` the width of one expert's MLP (0: ``ffn``), ``moe_layers`` how many blocks are MoE -- the
    last ones (0: all), ``shared_ffn`` the total width of the shared experts every token visits (0: none).
    Experts and shared experts are gated when ``gated_mlp``; with ``bias`` they (and the router) have biases.

    What Hugging Face families add (`from_hf`; all 0/False for the reference GPT): ``head_size`` the width of a
    head when it is not ``h / a`` (Gemma's 256, Qwen3's ``head_dim``; 0: ``h / a``); ``qkv_bias``: q, k, v have
    biases in a model without others (Qwen2); ``extra_norms``: norm weights per block beside its two norms (Qwen3's
    and OLMoE's q/k norms, Gemma-2's extra two, the low-rank norms of DeepSeek's attention); ``attention_matrices``:
    one block's attention weights when they are not q, k, v, o of ``head_size`` (DeepSeek's multi-head latent
    attention, MLA: its low-rank projections; 0: q, k, v, o); ``shared_expert_gate``: Qwen2-MoE's ``h x 1``
    gate of the shared experts in each MoE block; ``router_bias``: ``E`` router biases per MoE block in a model
    without other biases (ERNIE 4.5's score-correction biases, parameters there); ``positions``: rows of the learned
    position table (GPT-2's ``n_positions``; 0: ``seq_len``).

    ``window``: sliding-window attention -- a query attends the ``window`` keys up to itself -- in ``window_layers``
    of the blocks (0: all of them when ``window`` is set; Gemma's and GPT-OSS's alternate windowed and full layers):
    `attention_span`, the attention core's FLOPs where the runtime's kernel skips what the window masks
    (`lightning_hybrid.planner.cluster.Cluster.window_kernels`).

    ``lora_rank`` (``CausalLM(lora=...)``; 0: every parameter trains): LoRA adapters of that rank on the blocks'
    matrices (`lightning_hybrid.planner.placement.block_adapters`) train, everything else is frozen -- no
    gradients or optimizer state for it, no weight-gradient GEMMs, only the adapters' gradients reduced. ``params``
    counts the base.
    """

    name: str
    n_layer: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    gated_mlp: bool = False
    bias: bool = True
    learned_positions: bool = True
    tied_embeddings: bool = False
    params: int = 0
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    moe_layers: int = 0
    shared_ffn: int = 0
    head_size: int = 0
    qkv_bias: bool = False
    extra_norms: int = 0
    attention_matrices: int = 0
    shared_expert_gate: bool = False
    positions: int = 0
    router_bias: bool = False
    lora_rank: int = 0
    window: int = 0
    window_layers: int = 0

    def __post_init__(self) -> None:
        for field in ("n_layer", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{field}={value!r} is invalid: it must be a positive integer.")
        if (not self.head_size and self.hidden % self.heads) or self.heads % self.kv_heads:
            raise ValueError(f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}: heads must divide"
                             " hidden (unless head_size is given) and kv_heads must divide heads.")
        for field in ("experts", "top_k", "expert_ffn", "moe_layers", "shared_ffn", "head_size", "extra_norms",
                      "attention_matrices", "positions", "lora_rank", "window", "window_layers"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"ModelSpec.{field}={value!r} is invalid: it must be a non-negative integer.")
        if self.experts:
            if not 1 <= self.top_k <= self.experts:
                raise ValueError(f"top_k={self.top_k} is invalid for experts={self.experts}: each token visits"
                                 " 1 to experts of them.")
            if self.moe_layers > self.n_layer:
                raise ValueError(f"moe_layers={self.moe_layers} > n_layer={self.n_layer}.")
            object.__setattr__(self, "expert_ffn", self.expert_ffn or self.ffn)
            object.__setattr__(self, "moe_layers", self.moe_layers or self.n_layer)
        elif self.top_k or self.expert_ffn or self.moe_layers or self.shared_ffn:
            raise ValueError("top_k, expert_ffn, moe_layers and shared_ffn describe experts: set experts > 0 (the"
                             " number of experts per MoE layer), or leave them 0 for a dense model.")
        if self.window_layers > self.n_layer or (self.window_layers and not self.window):
            raise ValueError(f"window_layers={self.window_layers} is invalid: it counts the layers of the"
                             f" {self.n_layer} that attend within window={self.window} tokens (0: all of them, when"
                             " window > 0).")
        if self.window and not self.window_layers:
            object.__setattr__(self, "window_layers", self.n_layer)
        if not self.params:
            object.__setattr__(self, "params", sum(self.pipeline_layer_params()))
        # Hashed once (the planner's caches key on the spec; a frozen dataclass rehashes every field each time).
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash

    # ------------------------------------------------------------------------------------------- counts
    @property
    def head_dim(self) -> int:
        """The width of a head: ``head_size``, else ``h / a``."""
        return self.head_size or self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        """Whether some blocks hold experts."""
        return self.experts > 0

    def is_moe_block(self, index: int) -> bool:
        """Whether block ``index`` (1 .. L, its pipeline layer index) is a MoE block: the last ``moe_layers``."""
        return self.experts > 0 and self.n_layer - self.moe_layers < index <= self.n_layer

    def attention_weights(self) -> int:
        """q, o (``h x a*d``), k, v (``h x a_kv*d``); ``attention_matrices`` when given (MLA)."""
        if self.attention_matrices:
            return self.attention_matrices
        h, d = self.hidden, self.head_dim
        return 2 * h * self.heads * d + 2 * h * self.kv_heads * d

    def mlp_weights(self, width: int) -> int:
        """An MLP of ``width``: 2 or 3 (gated) ``h x width`` matrices."""
        return (3 if self.gated_mlp else 2) * self.hidden * width if width else 0

    def mlp_biases(self, width: int) -> int:
        """An MLP's biases when ``bias``: up (and gate) ``width``, down ``h``."""
        return ((2 if self.gated_mlp else 1) * width + self.hidden) if self.bias and width else 0

    def router_weights(self) -> int:
        """One MoE layer's router matrix: ``E x h`` (``(E + 1) x h`` with Qwen2-MoE's ``shared_expert_gate``)."""
        return (self.experts + (1 if self.shared_expert_gate else 0)) * self.hidden

    def router_params(self) -> int:
        """One MoE layer's router: `router_weights` (and ``E`` biases when ``bias`` or ``router_bias``)."""
        return self.router_weights() + (self.experts if self.bias or self.router_bias else 0)

    def expert_params(self) -> int:
        """One expert: an MLP of width ``expert_ffn`` (weights, and biases when ``bias``)."""
        return self.mlp_weights(self.expert_ffn) + self.mlp_biases(self.expert_ffn)

    def block_expert_params(self, moe: bool = True) -> int:
        """The experts of one block (what expert parallelism splits): ``E`` experts, or 0 for a dense block."""
        return self.experts * self.expert_params() if moe and self.experts else 0

    def block_column_weights(self) -> int:
        """A dense block's column layers' weights (TP splits their outputs): q, k, v and the MLP's up (and gate)
        -- all of `block_matmul_weights` but the two row layers' (o, the MLP's down)."""
        return self.attention_weights() - self.hidden * self.heads * self.head_dim + (
            self.mlp_weights(self.ffn) - self.hidden * self.ffn)

    def block_matmul_weights(self, moe: bool = False) -> int:
        """Weights of one block's matrices: q, o (``h x a*d``), k, v (``h x a_kv*d``) and the MLP (2 or 3 ``h x F``);
        a MoE block (``moe``): every expert (``E`` MLPs of ``F_e``), the shared experts (``F_s``) and the router."""
        if not (moe and self.experts):
            return self.attention_weights() + self.mlp_weights(self.ffn)
        return (self.attention_weights() + self.experts * self.mlp_weights(self.expert_ffn)
                + self.mlp_weights(self.shared_ffn) + self.router_weights())

    def block_active_weights(self, moe: bool = False) -> int:
        """The matrix weights one token multiplies by in a block: all of a dense block's; in a MoE block attention,
        its ``k`` experts, the shared experts and the router."""
        if not (moe and self.experts):
            return self.block_matmul_weights()
        return (self.attention_weights() + self.top_k * self.mlp_weights(self.expert_ffn)
                + self.mlp_weights(self.shared_ffn) + self.router_weights())

    def block_params(self, moe: bool = False) -> int:
        """One block: its matrices, their biases and two norms (weight, and bias when ``bias``); a MoE block
        (``moe``): attention, every expert, the shared experts and the router."""
        norms = 2 * self.hidden * (2 if self.bias else 1) + self.extra_norms
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        attention_biases = (qkv + self.hidden) if self.bias else (qkv if self.qkv_bias else 0)
        if not (moe and self.experts):
            return self.block_matmul_weights() + attention_biases + self.mlp_biases(self.ffn) + norms
        return (self.attention_weights() + attention_biases + norms + self.block_expert_params()
                + self.mlp_weights(self.shared_ffn) + self.mlp_biases(self.shared_ffn) + self.router_params())

    def embedding_params(self) -> int:
        """The token embedding (and a learned position table of ``positions``, else ``seq_len``, rows)."""
        rows = self.positions or self.seq_len
        return self.vocab * self.hidden + (rows * self.hidden if self.learned_positions else 0)

    def pipeline_layer_params(self) -> list[int]:
        """Parameters of ``embed, block_1 .. block_L, head`` (a tied head counted in the embedding)."""
        head = self.hidden * (2 if self.bias else 1) + (0 if self.tied_embeddings else self.vocab * self.hidden)
        dense = self.n_layer - self.moe_layers
        return [self.embedding_params(), *[self.block_params()] * dense, *[self.block_params(True)] * self.moe_layers,
                head]

    def active_params(self) -> int:
        """Parameters one token's computation uses: all but the ``E - k`` experts it does not visit per MoE layer
        (Mixtral 8x7B: 12.9B of 46.7B); ``params`` for a dense model."""
        return self.params - self.moe_layers * (self.experts - self.top_k) * self.expert_params()

    def attention_span(self) -> float:
        """The keys a query attends, on average over the layers, relative to causal attention over the whole
        sequence (1 without a window): a layer with a sliding window of ``w`` tokens -- a query at position ``i``
        attends ``min(i + 1, w)`` keys, transformers' and FlashAttention's convention -- attends
        ``(w (w + 1) / 2 + (s - w) w) / (s (s + 1) / 2)`` of them; ``window_layers`` of the ``L`` layers do."""
        s, w = self.seq_len, self.window
        if not w or w >= s:
            return 1.0
        windowed = (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)
        return (self.window_layers * windowed + self.n_layer - self.window_layers) / self.n_layer

    def flops_per_token(self) -> int:
        """Training FLOPs (forward + backward, no recomputation) per token: ``6`` per matmul weight -- every
        block's and the LM head's; embeddings are lookups -- plus ``12 L h s`` for the attention scores and their
        weighted sum (PaLM, Chowdhery et al. 2022, appendix B; the same count as ``GPT.flops_per_token``). A MoE
        block counts the weights a token multiplies by (`block_active_weights`: ``k`` experts, the shared
        experts and the router ``E x h``), not every expert; under LoRA ``4`` (no weight gradients). With sliding
        windows the attention term is the keys the model attends (x `attention_span`)."""
        dense = self.n_layer - self.moe_layers
        blocks = dense * self.block_active_weights() + self.moe_layers * self.block_active_weights(True)
        weights = blocks + self.hidden * self.vocab
        attention = 12 * self.n_layer * self.hidden * self.seq_len * self.attention_span()
        return (4 if self.lora_rank else 6) * weights + round(attention)

    def with_seq_len(self, seq_len: Optional[int]) -> "ModelSpec":
        """The same model at another sequence length (the parameter count is kept)."""
        return self if not seq_len else dataclasses.replace(self, seq_len=int(seq_len))

    # ------------------------------------------------------------------------------------------- builders
    @classmethod
    def from_gpt(cls, config: Any, seq_len: Optional[int] = None, name: str = "gpt") -> "ModelSpec":
        """From a `lightning_hybrid.models.GPTConfig` (or a dict of its fields); ``seq_len`` defaults to
        ``block_size``."""
        from lightning_hybrid.models import GPTConfig

        c = config if isinstance(config, GPTConfig) else GPTConfig(**dict(config))
        return cls(name=name, n_layer=c.n_layer, hidden=c.n_embd, heads=c.n_head, kv_heads=c.n_kv_head,
                   ffn=c.mlp_hidden, vocab=c.vocab_size, seq_len=int(seq_len or c.block_size),
                   gated_mlp=c.mlp == "swiglu", bias=c.bias)

    @classmethod
    def from_hf(cls, config: Any, seq_len: Optional[int] = None) -> "ModelSpec":
        """From a ``transformers.PretrainedConfig`` (no download; names read through ``attribute_map``): layers,
        width, query and key/value heads (GQA), ``head_dim`` when it is not ``h / a`` (Gemma, Qwen3), the MLP
        (gated -- SwiGLU, GeGLU -- unless the family's MLP is plain, `PLAIN_MLP_FAMILIES`), biases (everywhere for
        `BIAS_FAMILIES`; q, k, v only: Qwen2's, ``attention_bias``, ``qkv_bias``), tied embeddings, learned positions
        (GPT-2's ``n_positions`` table), q/k norms, DeepSeek's multi-head latent attention (its low-rank
        projections and norms: ``attention_matrices``, ``extra_norms``; heads of ``qk_nope_head_dim +
        qk_rope_head_dim``), the experts (`lightning_hybrid.planner.hf_configs.hf_experts`) and sliding windows
        (`hf_windows`). ``seq_len`` defaults to ``max_position_embeddings`` (``n_positions``). What it does not model:
        `hf_notes`; the parameter count it derives equals ``AutoModelForCausalLM.from_config(config)``'s for the
        families tests/planner/test_planner_hf.py builds (`hf_parameter_count` checks any other)."""
        def first(*names: str, default: Any = None) -> Any:
            for n in names:
                value = getattr(config, n, None)
                if value is not None:
                    return value
            if default is None:
                raise ValueError(f"{type(config).__name__} has none of {list(names)}: cannot describe the model.")
            return default

        family = str(getattr(config, "model_type", None) or type(config).__name__)
        hidden = int(first("hidden_size", "n_embd", "d_model"))
        heads = int(first("num_attention_heads", "n_head"))
        kv_heads = int(first("num_key_value_heads", "num_kv_heads", default=heads))
        n_layer = int(first("num_hidden_layers", "n_layer"))
        head_size = int(first("head_dim", default=0) or 0)
        full_bias = family in BIAS_FAMILIES or bool(getattr(config, "use_bias", False))
        attention_bias = bool(getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False)
                              or family in ("qwen2", "qwen2_vl", "qwen2_5_vl"))
        extra: dict[str, Any] = {}
        if getattr(config, "kv_lora_rank", None):  # DeepSeek-V2/V3 multi-head latent attention
            q_rank, kv_rank = getattr(config, "q_lora_rank", None), int(config.kv_lora_rank)
            nope, rope, v = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim), int(config.v_head_dim)
            q = hidden * int(q_rank) + int(q_rank) * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
            extra["attention_matrices"] = (q + hidden * (kv_rank + rope) + kv_rank * heads * (nope + v)
                                           + heads * v * hidden)
            extra["extra_norms"] = kv_rank + (int(q_rank) if q_rank else 0)
            kv_heads, head_size = heads, nope + rope
        elif family in QK_NORMS:
            d = head_size or hidden // heads
            extra["extra_norms"] = 2 * d if QK_NORMS[family] == "head" else (heads + kv_heads) * d
        if family in FOUR_NORM_FAMILIES:
            extra["extra_norms"] = extra.get("extra_norms", 0) + 2 * hidden
        if head_size == hidden // heads and hidden % heads == 0:
            head_size = 0
        learned = family in LEARNED_POSITIONS
        if learned:
            extra["positions"] = int(first(LEARNED_POSITIONS[family]))
        moe = hf_experts(config, n_layer)
        if moe and family == "qwen2_moe" and moe.get("shared_ffn"):
            extra["shared_expert_gate"] = True
        if moe and family == "ernie4_5_moe":  # its MoE statistics: a score-correction bias per expert, a parameter
            extra["router_bias"] = True
        return cls(
            name=family, n_layer=n_layer, hidden=hidden, heads=heads, kv_heads=kv_heads,
            ffn=int(first("intermediate_size_mlp", "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)),
            vocab=int(first("vocab_size")),
            seq_len=int(seq_len or first("max_position_embeddings", "n_positions", default=2048)),
            gated_mlp=family not in PLAIN_MLP_FAMILIES, bias=full_bias,
            learned_positions=learned, tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            head_size=head_size, qkv_bias=attention_bias and not full_bias, **moe, **extra,
            **hf_windows(config, n_layer),
        )

    @classmethod
    def from_module(cls, module: nn.Module, seq_len: Optional[int] = None) -> "ModelSpec":
        """From a model object: sizes from its ``config`` (a `GPTConfig` or a Hugging Face config, looked up on
        the module and its ``model``) or, without one, from its layers (the longest ``nn.ModuleList`` = blocks,
        the first embedding = vocabulary x width, the widest Linear in a block = MLP); the parameter count is
        always the module's own (shared tensors once)."""
        from lightning_hybrid.models import GPTConfig

        params = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
        for owner in (module, getattr(module, "model", None)):
            config = getattr(owner, "config", None)
            if isinstance(config, GPTConfig):
                return dataclasses.replace(cls.from_gpt(config, seq_len, name=type(module).__name__), params=params)
            if config is not None and hasattr(config, "to_dict") and hasattr(config, "model_type"):
                return dataclasses.replace(cls.from_hf(config, seq_len), params=params)
        lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
        embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
        if not lists or not embeddings or seq_len is None:
            raise ValueError(f"{type(module).__name__} has no config the planner reads: counting its layers needs an"
                             " nn.ModuleList of blocks, an nn.Embedding and seq_len.")
        blocks = max(lists, key=len)
        vocab, hidden = embeddings[0].weight.shape
        ffn = max(max(m.in_features, m.out_features) for m in blocks[0].modules() if isinstance(m, nn.Linear))
        heads = next((int(getattr(m, n)) for m in blocks[0].modules() for n in ("n_head", "num_heads", "heads")
                      if isinstance(getattr(m, n, None), int)), 1)
        return cls(name=type(module).__name__, n_layer=len(blocks), hidden=int(hidden), heads=heads, kv_heads=heads,
                   ffn=int(ffn), vocab=int(vocab), seq_len=int(seq_len), params=params)


#: Published models (sequence length 2048, vocabulary 51,200 for the GPT rows as in Narayanan et al. 2021,
#: Table 1), Mixtral (Jiang et al. 2024; trained at 32k, planned here at 4096), and the recipe's own
#: ``model=tiny`` / ``model=small`` (configs/model/*.yaml) with ``small-moe`` its 8-expert top-2 sibling.
MODEL_PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec("tiny", n_layer=1, hidden=32, heads=4, kv_heads=4, ffn=128, vocab=256, seq_len=32),
    "small": ModelSpec("small", n_layer=4, hidden=256, heads=8, kv_heads=8, ffn=1024, vocab=256, seq_len=128),
    "gpt-1.7b": ModelSpec("gpt-1.7b", 24, 2304, 24, 24, 4 * 2304, 51200, 2048),
    "gpt-18b": ModelSpec("gpt-18b", 40, 6144, 48, 48, 4 * 6144, 51200, 2048),
    "gpt-39b": ModelSpec("gpt-39b", 48, 8192, 64, 64, 4 * 8192, 51200, 2048),
    "gpt-145b": ModelSpec("gpt-145b", 80, 12288, 96, 96, 4 * 12288, 51200, 2048),
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96, 96, 4 * 12288, 51200, 2048),
    "gpt-1t": ModelSpec("gpt-1t", 128, 25600, 160, 160, 4 * 25600, 51200, 2048),
    "llama2-7b": ModelSpec("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, gated_mlp=True, bias=False,
                           learned_positions=False),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, gated_mlp=True, bias=False,
                            learned_positions=False),
    "small-moe": ModelSpec("small-moe", n_layer=4, hidden=256, heads=8, kv_heads=8, ffn=1024, vocab=256, seq_len=128,
                           experts=8, top_k=2, expert_ffn=512),
    "mixtral-8x7b": ModelSpec("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 4096, gated_mlp=True, bias=False,
                              learned_positions=False, experts=8, top_k=2),
    "mixtral-8x22b": ModelSpec("mixtral-8x22b", 56, 6144, 48, 8, 16384, 32768, 4096, gated_mlp=True, bias=False,
                               learned_positions=False, experts=8, top_k=2),
}

#: ``model_spec``'s MoE fields (not `GPTConfig` fields): ``experts=8,top_k=2,expert_ffn=..,moe_layers=..,
#: shared_ffn=..``.
MOE_FIELDS = ("experts", "top_k", "expert_ffn", "moe_layers", "shared_ffn")


def model_spec(text: str, seq_len: Optional[int] = None) -> ModelSpec:
    """A `ModelSpec` from the command line: a preset name (`MODEL_PRESETS`), a Hugging Face ``config.json``
    (a file or a folder holding one), or `GPTConfig` field overrides ``n_layer=12,n_embd=768,...``, each with
    mixture-of-experts fields (`MOE_FIELDS`) ``experts=8,top_k=2,expert_ffn=1024,moe_layers=..,shared_ffn=..``.
    A preset takes overrides of any `ModelSpec` field after it: ``llama2-7b,experts=8,top_k=2``."""
    if text in MODEL_PRESETS:
        return MODEL_PRESETS[text].with_seq_len(seq_len)
    head, _, rest = text.partition(",")
    if head in MODEL_PRESETS and rest:
        names = {f.name for f in dataclasses.fields(ModelSpec)} - {"params"}
        overrides = {}
        for item in rest.split(","):
            key, _, value = item.partition("=")
            if key.strip() not in names:
                raise ValueError(f"--model {text!r}: {key.strip()!r} is not a ModelSpec field ({sorted(names)}).")
            overrides[key.strip()] = value.strip() if key.strip() == "name" else json.loads(value)
        return dataclasses.replace(MODEL_PRESETS[head], params=0, **overrides).with_seq_len(seq_len)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelSpec.from_hf(hf_config(path), seq_len)
    if "=" in text:
        fields = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            fields[key.strip()] = value if key.strip() == "mlp" else json.loads(value)
        moe = {k: fields.pop(k) for k in MOE_FIELDS if k in fields}
        spec = ModelSpec.from_gpt(fields, seq_len)
        return dataclasses.replace(spec, params=0, **moe) if moe else spec
    raise ValueError(f"--model {text!r} is neither a preset ({sorted(MODEL_PRESETS)}), a config.json nor GPTConfig"
                     " fields (n_layer=12,n_embd=768,...; MoE: experts=8,top_k=2,...).")
