"""What the planner knows about a model: its shape, parameter counts and training FLOPs per token.

`ModelSpec` is a decoder-only transformer described by its sizes (``L`` layers, width ``h``, ``a`` query heads,
``a_kv`` key/value heads, MLP size ``F``, vocabulary ``V``, sequence length ``s``). It is built from a
`GPTConfig` (`ModelSpec.from_gpt`), a Hugging Face ``PretrainedConfig`` (`ModelSpec.from_hf`, no download),
an ``nn.Module`` (`ModelSpec.from_module`: its parameters counted, its sizes read from its config or its layers)
or a preset name (`MODEL_PRESETS`, `model_spec`).

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

__all__ = ["MODEL_PRESETS", "ModelSpec", "model_spec"]


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a decoder-only transformer.

    ``gated_mlp``: SwiGLU (three MLP matrices) instead of GELU (two); ``bias``: Linear/LayerNorm biases;
    ``learned_positions``: a ``seq_len x h`` position table (GPT-2 style) instead of rotary embeddings;
    ``tied_embeddings``: the LM head reuses the token embedding. ``params``: the parameter count, computed
    from the sizes unless given (a module's own count).
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

    def __post_init__(self) -> None:
        for field in ("n_layer", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{field}={value!r} is invalid: it must be a positive integer.")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}: heads must divide"
                             " hidden and kv_heads must divide heads.")
        if not self.params:
            object.__setattr__(self, "params", sum(self.pipeline_layer_params()))

    # ------------------------------------------------------------------------------------------- counts
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block_matmul_weights(self) -> int:
        """Weights of one block's matrices: q, o (``h x a*d``), k, v (``h x a_kv*d``) and the MLP (2 or 3 ``h x F``)."""
        h, d = self.hidden, self.head_dim
        return 2 * h * self.heads * d + 2 * h * self.kv_heads * d + (3 if self.gated_mlp else 2) * h * self.ffn

    def block_params(self) -> int:
        """One block: its matrices, their biases and two norms (weight, and bias when ``bias``)."""
        biases = (self.heads + 2 * self.kv_heads) * self.head_dim + self.hidden  # q, k, v, o
        biases += (2 if self.gated_mlp else 1) * self.ffn + self.hidden  # up (and gate), down
        norms = 2 * self.hidden * (2 if self.bias else 1)
        return self.block_matmul_weights() + (biases if self.bias else 0) + norms

    def pipeline_layer_params(self) -> list[int]:
        """Parameters of ``embed, block_1 .. block_L, head`` (a tied head counted in the embedding)."""
        embed = self.vocab * self.hidden + (self.seq_len * self.hidden if self.learned_positions else 0)
        head = self.hidden * (2 if self.bias else 1) + (0 if self.tied_embeddings else self.vocab * self.hidden)
        return [embed, *[self.block_params()] * self.n_layer, head]

    def flops_per_token(self) -> int:
        """Training FLOPs (forward + backward, no recomputation) per token: ``6`` per matmul weight -- every
        block's and the LM head's; embeddings are lookups -- plus ``12 L h s`` for the attention scores and their
        weighted sum (PaLM, Chowdhery et al. 2022, appendix B; the same count as ``GPT.flops_per_token``)."""
        weights = self.n_layer * self.block_matmul_weights() + self.hidden * self.vocab
        return 6 * weights + 12 * self.n_layer * self.hidden * self.seq_len

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
        """From a ``transformers.PretrainedConfig`` (Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, ... names read
        through ``attribute_map``); ``seq_len`` defaults to ``max_position_embeddings`` (``n_positions``)."""
        def first(*names: str, default: Any = None) -> Any:
            for n in names:
                value = getattr(config, n, None)
                if value is not None:
                    return value
            if default is None:
                raise ValueError(f"{type(config).__name__} has none of {list(names)}: cannot describe the model.")
            return default

        hidden = int(first("hidden_size", "n_embd", "d_model"))
        heads = int(first("num_attention_heads", "n_head"))
        act = str(first("hidden_act", "activation_function", default="gelu"))
        gated = (act in ("silu", "swiglu")
                 or getattr(config, "model_type", "") in ("llama", "mistral", "qwen2", "qwen3", "gemma"))
        return cls(
            name=str(getattr(config, "model_type", None) or type(config).__name__),
            n_layer=int(first("num_hidden_layers", "n_layer")), hidden=hidden, heads=heads,
            kv_heads=int(first("num_key_value_heads", default=heads)),
            ffn=int(first("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)),
            vocab=int(first("vocab_size")),
            seq_len=int(seq_len or first("max_position_embeddings", "n_positions", default=2048)),
            gated_mlp=gated, bias=bool(getattr(config, "attention_bias", getattr(config, "use_bias", not gated))),
            learned_positions=getattr(config, "model_type", "") in ("gpt2", "opt", "gpt_bigcode"),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
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
#: Table 1) and the recipe's own ``model=tiny`` / ``model=small`` (configs/model/*.yaml).
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
}


def model_spec(text: str, seq_len: Optional[int] = None) -> ModelSpec:
    """A `ModelSpec` from the command line: a preset name (`MODEL_PRESETS`), a Hugging Face ``config.json``
    (a file or a folder holding one), or `GPTConfig` field overrides ``n_layer=12,n_embd=768,...``."""
    if text in MODEL_PRESETS:
        return MODEL_PRESETS[text].with_seq_len(seq_len)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        from transformers import AutoConfig

        fields = json.loads(path.read_text())
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        return ModelSpec.from_hf(config, seq_len)
    if "=" in text:
        fields = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            fields[key.strip()] = value if key.strip() == "mlp" else json.loads(value)
        return ModelSpec.from_gpt(fields, seq_len)
    raise ValueError(f"--model {text!r} is neither a preset ({sorted(MODEL_PRESETS)}), a config.json nor GPTConfig"
                     " fields (n_layer=12,n_embd=768,...).")
