"""Tiny random-init models of `transformers` families (built from a config: nothing downloaded), fp32, no
dropout, a byte vocabulary (256), and a LightningModule that trains one like the reference GPT."""

from __future__ import annotations

import torch

from lightning_hybrid.models import GPTLightningModule

VOCAB, HIDDEN, LAYERS, HEADS, FFN = 256, 32, 2, 4, 64
_DROPOUTS = ("attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout", "attention_dropout", "embed_dropout",
             "activation_dropout", "dropout")


_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)


def tiny_config(family: str):
    import transformers as T

    common = dict(vocab_size=VOCAB, max_position_embeddings=64)
    llama_like = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
                      intermediate_size=FFN, **common)
    configs = {
        "gpt2": lambda: T.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=64),
        "gpt_neox": lambda: T.GPTNeoXConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                            intermediate_size=FFN, **common),
        "bloom": lambda: T.BloomConfig(hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB),
        "phi3": lambda: T.Phi3Config(**llama_like, pad_token_id=0, original_max_position_embeddings=64),
        "falcon": lambda: T.FalconConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                         vocab_size=VOCAB, new_decoder_architecture=True, num_kv_heads=2),
        "llama": lambda: T.LlamaConfig(**llama_like),
        "qwen2": lambda: T.Qwen2Config(**llama_like),
        "mistral": lambda: T.MistralConfig(**llama_like),
        # Mixture-of-experts: 4 experts, top-2, the router's load-balancing loss on (a large coefficient, so that
        # a wrong one shows).
        "mixtral": lambda: T.MixtralConfig(**llama_like, num_local_experts=4, **_MOE),
        "olmoe": lambda: T.OlmoeConfig(**llama_like, num_experts=4, **_MOE),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(**llama_like, num_experts=4, moe_intermediate_size=FFN // 2, **_MOE),
        # DeepSeek-V3: a dense first layer, MLA attention, grouped routing with a bias, a shared expert, no
        # load-balancing loss. GPT-OSS: experts with biases, attention sinks.
        "deepseek_v3": lambda: T.DeepseekV3Config(
            **{**llama_like, "num_key_value_heads": HEADS}, moe_intermediate_size=FFN // 2, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
            rope_scaling=None),
        "gpt_oss": lambda: T.GptOssConfig(**{**llama_like, "intermediate_size": FFN // 2}, num_local_experts=4,
                                          head_dim=HIDDEN // HEADS, **_MOE),
    }
    config = configs[family]()
    for name in _DROPOUTS:
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    config.tie_word_embeddings = False
    return config


def build(family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(tiny_config(family)).float()


class FamilyLM(GPTLightningModule):
    """Next-byte prediction with a transformers causal LM of ``family`` (random init), trained like our GPT."""

    def __init__(self, family: str, **kwargs) -> None:
        super().__init__(vocab_size=VOCAB, block_size=64, **kwargs)
        self.family = family

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build(self.family)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits
