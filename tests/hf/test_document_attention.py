"""Packed documents without (T x T) masks: `document_attention` against the masked SDPA (values, gradients, grouped
heads, sliding windows), and a transformers model's `DocumentAttention` -- verified on its first packed forward,
then used; kept on the model's own masks wherever it does not verify -- and `VerifiedAttention`: another
implementation (flex attention, a user's kernel) verified on its first packed batch, refused where it differs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_hybrid.core.batch import document_causal_mask
from lightning_hybrid.core.document_attention import document_attention, document_spans
from lightning_hybrid.hf import CausalLM

POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
                          list(range(24)),
                          [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 0, 0, 0]])
DOCUMENTS = [(0, 10), (10, 13), (13, 24)]  # of row 0


def _windowed_mask(positions: torch.Tensor, window: int) -> torch.Tensor:
    places = torch.arange(positions.size(1))
    distance = places.unsqueeze(1) - places.unsqueeze(0)
    return document_causal_mask(positions) & (distance < window)


def test_spans_are_the_documents_of_each_row():
    spans = document_spans(POSITIONS)
    assert spans[0] == DOCUMENTS and spans[1] == [(0, 24)]
    assert spans[2] == [(0, 6), (6, 20), (20, 21), (21, 22), (22, 23), (23, 24)]
    # Read once per tensor (every layer gets the same positions), again once it changes in place.
    assert document_spans(POSITIONS) is spans
    changed = POSITIONS.clone()
    assert document_spans(changed) == spans
    changed[1, 12:] = torch.arange(12)
    assert document_spans(changed)[1] == [(0, 12), (12, 24)]


@pytest.mark.parametrize("kv_heads, window", [(4, None), (2, None), (4, 5)])
def test_document_attention_is_the_masked_sdpa(kv_heads, window):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 24, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(3, kv_heads, 24, 8, generator=g, requires_grad=True) for _ in range(2))
    mask = document_causal_mask(POSITIONS) if window is None else _windowed_mask(POSITIONS, window)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != 4)
    ours = document_attention(q, k, v, POSITIONS, window=window)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)
    out_grad = torch.randn(ours.shape, generator=g)
    grads = [torch.autograd.grad(y, (q, k, v), out_grad) for y in (ours, reference)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    # Without positions (or with one document per row): plain causal attention.
    torch.testing.assert_close(document_attention(q, k, v), F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=kv_heads != 4), rtol=0, atol=0)


def _model(family: str, attn_implementation: str = "sdpa", **config) -> CausalLM:
    torch.manual_seed(0)
    module = CausalLM(family, config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128, **config),
                      attn_implementation=attn_implementation)
    module.configure_model()
    return module


@pytest.mark.parametrize("family, config", [("llama", {}), ("mistral", {"sliding_window": 6})])
def test_a_transformers_model_verifies_then_runs_per_document(family, config):
    module = _model(family, **config)
    attention = module.document_attention
    assert attention is not None and module.model.config._attn_implementation == attention.name
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    first = module(ids, position_ids=POSITIONS)  # the model's masked SDPA, and the verification
    assert attention.failed is None and len(attention.verified) == 2 and not attention.fast
    later = module(ids, position_ids=POSITIONS)
    assert attention.fast  # no masks any more
    torch.testing.assert_close(later, first, rtol=0, atol=1e-6)
    alone = torch.cat([module(ids[:1, s:e], position_ids=POSITIONS[:1, s:e]) for s, e in DOCUMENTS], 1)
    torch.testing.assert_close(later[:1], alone, rtol=0, atol=1e-6)
    later.sum().backward()  # trains
    # The name of the implementation is not saved with the config.
    assert attention.name not in str(module.model.config.to_dict())


def test_what_does_not_verify_keeps_the_models_own_masks():
    # Attention dropout draws differ per call: nothing to compare, so the masked SDPA stays.
    module = _model("llama", attention_dropout=0.5)
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    module.train()
    module(ids, position_ids=POSITIONS)
    module(ids, position_ids=POSITIONS)
    attention = module.document_attention
    assert not attention.fast and "attention dropout" in attention.failed
    # A layer that does not hand its attention the positions cannot be split into documents.
    module = _model("llama")
    attention = module.document_attention
    layer = module.model.model.layers[0].self_attn
    q = torch.randn(1, 4, 24, 16)
    kv = torch.randn(1, 2, 24, 16)
    mask = document_causal_mask(POSITIONS[:1])
    out, _ = attention.attention(layer, q, kv, kv, mask, scaling=0.25)
    torch.testing.assert_close(out.transpose(1, 2), F.scaled_dot_product_attention(
        q, kv, kv, attn_mask=mask, scale=0.25, enable_gqa=True), rtol=0, atol=1e-6)
    assert "position_ids" in attention.failed and not attention.verified
    module(torch.randint(0, 128, (3, 24)), position_ids=POSITIONS)
    assert not attention.fast  # for the rest of the run


def test_only_sdpa_models_without_context_parallelism_get_it():
    module = CausalLM("llama", config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=128),
                      attn_implementation="eager")
    module.configure_model()
    assert module.document_attention is None and module.model.config._attn_implementation == "eager"


@pytest.mark.parametrize("implementation", ["user_per_document", "flex_attention"])
def test_another_implementation_is_verified_on_its_first_packed_batch_and_kept(implementation):
    """An implementation that takes no (T x T) mask -- one registered by the user that reads the documents from the
    positions, transformers' flex_attention (its document BlockMask; forward only: torch 2.13 has no flex backward on
    CPU) -- stays the model's, checked on each layer's first packed call against one device's attention of each
    document alone: verified, and then the SDPA model's packed logits."""
    import tests.hf.attention_implementations  # noqa: F401  (registers the user's implementations)
    from lightning_hybrid.hf.document_attention import VerifiedAttention

    module = _model("llama", attn_implementation=implementation)
    attention = module.document_attention
    assert isinstance(attention, VerifiedAttention) and module.model.config._attn_implementation == attention.name
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        module(ids, position_ids=POSITIONS[1:2].expand(3, -1))  # one document a row: nothing to verify
        assert not attention.verified
        got = module(ids, position_ids=POSITIONS)
    assert len(attention.verified) == 2
    torch.testing.assert_close(got, _model("llama")(ids, position_ids=POSITIONS), rtol=0, atol=1e-5)
    if implementation == "user_per_document":
        module(ids, position_ids=POSITIONS).sum().backward()  # trains
        # Under attention dropout the comparison is of a call without it (the training call's draws stay its own).
        module = _model("llama", attn_implementation=implementation, attention_dropout=0.5).train()
        module(ids, position_ids=POSITIONS).sum().backward()
        assert len(module.document_attention.verified) == 2


def test_an_implementation_that_lets_documents_see_each_other_is_refused_naming_the_layer():
    import tests.hf.attention_implementations  # noqa: F401

    module = _model("llama", attn_implementation="user_leaky")
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    module(ids)  # unpacked: nothing to verify, and nothing wrong
    with pytest.raises(ValueError, match=r"LlamaAttention \(layer 0\) under attn_implementation='user_leaky': on a"
                                         r" packed batch its attention differs from one device's attention of each"
                                         r" document alone by .* train it on unpacked batches padded on the right"
                                         r" only, or with attn_implementation='sdpa'"):
        module(ids, position_ids=POSITIONS)


@pytest.mark.parametrize("implementation", ["sdpa", "user_per_document"])
def test_once_verified_a_packed_layer_traces_into_one_graph(implementation):
    """Under compile the verification stays out of the layers: the first packed forward runs eagerly
    (`first_packed_stance`), and a decoder layer traced after it is one graph, its document mask built on the device
    (no host sync asking whether the batch is packed)."""
    import tests.hf.attention_implementations  # noqa: F401
    from lightning_hybrid.hf.document_attention import first_packed_stance

    module = _model("llama", attn_implementation=implementation)
    layer, calls = module.model.model.layers[0], []
    hook = layer.register_forward_pre_hook(lambda m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    assert type(first_packed_stance(module.document_attention, POSITIONS)).__name__ != "nullcontext"
    module(ids, position_ids=POSITIONS).sum().backward()
    module(ids, position_ids=POSITIONS)
    hook.remove()
    assert type(first_packed_stance(module.document_attention, POSITIONS)).__name__ == "nullcontext"
    args, kwargs = calls[-1]
    explained = torch._dynamo.explain(layer)(*args, **kwargs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("implementation", ["sdpa", "user_per_document"])
def test_a_pipelines_decoder_layer_gets_its_arguments_out_of_its_graph(implementation, monkeypatch):
    """Under ``pp > 1`` the stages call the decoder layers, each inside `CausalLM.pipeline_layer_context`: a layer's
    first call its attention verifies on (packed; under SDPA any with positions) eager, whether the positions are
    packed asked once a micro-batch until then, and the layer's other arguments computed there (for each
    micro-batch's positions; without positions once a shape, in an eager first call) -- so that the layer traces
    into one graph, its hook reading them."""
    import tests.hf.attention_implementations  # noqa: F401
    from lightning_hybrid.hf import decomposition

    module = _model("llama", attn_implementation=implementation)
    layers = module.pipeline_layers()
    embed, decoder = layers[0], layers[1:3]
    asked, is_packed = [], decomposition.is_packed
    monkeypatch.setattr(decomposition, "is_packed", lambda p: asked.append(p) or is_packed(p))
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(1))
    one_each = torch.arange(24).expand(3, 24)  # rows of one document each: SDPA verifies on them, a kernel not
    stances = []
    for positions in (one_each, POSITIONS, POSITIONS.clone(), None, None):
        side = {} if positions is None else {"position_ids": positions}
        hidden = embed(ids)
        for layer in decoder:
            with module.pipeline_layer_context(layer, hidden, side):
                stances.append(torch._dynamo.eval_frame._stance.stance)
                hidden = layer(hidden, **side)
    eager = "force_eager"
    if implementation == "sdpa":  # settled on the first micro-batch with positions
        assert stances == [eager, eager, "default", "default", "default", "default", eager, eager, "default", "default"]
        assert [p is one_each for p in asked] == [True]
    else:  # on the first packed one; the micro-batch before asked once for its two layers
        assert stances == ["default", "default", eager, eager, "default", "default", eager, eager, "default", "default"]
        assert [p is one_each for p in asked] == [True, False]
    assert module.document_attention.packed_layers == {id(layer) for layer in decoder}
    for side in ({"position_ids": POSITIONS.clone()}, {}):
        hidden = embed(ids).detach()
        with module.pipeline_layer_context(decoder[0], hidden, side):
            explained = torch._dynamo.explain(decoder[0])(hidden, **side)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (side, explained.break_reasons)
