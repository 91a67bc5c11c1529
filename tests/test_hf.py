"""`lightning_hybrid.hf.CausalLM`: Hugging Face causal LMs (random init from a config; nothing downloaded)
under pipeline layouts against the same module on one process, the refusals, and pretrained folders in and out."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("transformers")

import transformers as T  # noqa: E402

from lightning_hybrid.hf import CausalLM, PipelineDecompositionError, pipeline_structure  # noqa: E402
from tests.families import tiny_config  # noqa: E402
from tests.parity import check_world  # noqa: E402

FAMILIES = ("llama", "qwen2", "gpt_neox", "gpt2")
# Adam turns a gradient at the scale of its eps into an update of order lr, so fp32 reordering noise in such a
# gradient moves one element by ~2% of lr (see test_tensor_parallel_models): lr * 0.02 < 1e-5.
LR = 2e-4
STEPS = 4


def _lm(family: str) -> CausalLM:
    return CausalLM(tiny_config(family), lr=LR)


def _built(config) -> CausalLM:
    module = CausalLM(config)
    module.configure_model()
    return module


# ---------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("family", [*FAMILIES, "bloom", "falcon", "phi3", "gemma"])
def test_pipeline_layers_compose_to_the_model(family):
    config = tiny_config(family) if family != "gemma" else T.GemmaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=256, head_dim=8, tie_word_embeddings=False)
    module = _built(config)
    x = torch.randint(0, 256, (2, 12))
    want = module(x)
    h = x
    for layer in module.pipeline_layers():
        h = layer(h)
    torch.testing.assert_close(h, want, rtol=0, atol=0)
    # The model's own forward is unchanged by the hooks the layers now carry.
    torch.testing.assert_close(module(x), want, rtol=0, atol=0)


def test_structure_follows_the_model():
    names = pipeline_structure(_built(tiny_config("gpt2")).model)
    assert names == ["transformer.wte", "transformer.wpe", "transformer.drop", "transformer.h.0", "transformer.h.1",
                     "transformer.ln_f", "lm_head"]
    names = pipeline_structure(_built(tiny_config("gpt_neox")).model)
    assert names[:2] == ["gpt_neox.embed_in", "gpt_neox.emb_dropout"] and names[-2:] == ["gpt_neox.final_layer_norm", "lm_head"]


def test_same_init_on_every_layout_and_a_seed_of_its_own():
    a, b = _built(tiny_config("llama")), _built(tiny_config("llama"))
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    c = CausalLM(tiny_config("llama"), init_seed=1)
    c.configure_model()
    assert not torch.equal(a.model.model.embed_tokens.weight, c.model.model.embed_tokens.weight)


def test_models_the_layers_cannot_reproduce_are_refused():
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                 vocab_size=256, head_dim=8, tie_word_embeddings=False)
    with pytest.raises(PipelineDecompositionError, match="after its last decoder layer"):  # logit soft-capping
        _built(T.Gemma2Config(**small, final_logit_softcapping=30.0)).pipeline_layers()
    with pytest.raises(PipelineDecompositionError, match="cannot be cut into pipeline layers exactly"):  # OPT's offset positions
        _built(T.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, vocab_size=256,
                           tie_word_embeddings=False)).pipeline_layers()
    with pytest.raises(PipelineDecompositionError, match="tie_word_embeddings=False"):
        _built(T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=256)).pipeline_layers()


# ---------------------------------------------------------------------------------------------- layouts
def _no_rank_holds_the_whole_model(results: list[dict], references: dict) -> None:
    for rank, per_run in enumerate(results):
        for name, got in per_run.items():
            assert got["param_bytes"] < references[name]["param_bytes"], f"{name}: rank {rank} holds the whole model"


def test_families_under_pipeline_layouts_match_one_device():
    runs = {f"pp2-{family}": (dict(pp=2, micro_batches=2), partial(_lm, family), {}) for family in FAMILIES}
    runs["pp2-interleaved-gpt_neox"] = (
        dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, micro_batches=2), partial(_lm, "gpt_neox"), {})
    references: dict = {}
    _no_rank_holds_the_whole_model(check_world(2, runs, steps=STEPS, references=references), references)


def test_families_under_tp_pp_and_3d_layouts_match_one_device():
    runs = {f"tp2xpp2-{family}": (dict(tp=2, pp=2, micro_batches=2), partial(_lm, family), {}) for family in ("llama", "gpt2")}
    references: dict = {}
    _no_rank_holds_the_whole_model(check_world(4, runs, steps=STEPS, references=references), references)
    runs = {
        f"dp2xtp2xpp2-zero{stage}-{family}": (dict(dp=2, tp=2, pp=2, zero_stage=stage, micro_batches=2), partial(_lm, family), {})
        for stage, family in ((0, "qwen2"), (1, "gpt_neox"), (3, "llama"))
    }
    _no_rank_holds_the_whole_model(check_world(8, runs, steps=STEPS, references=references), references)
