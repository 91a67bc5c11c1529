"""Fine-tuning batches -- padded (left and right) and packed documents with prompt tokens masked out of the loss --
train under every layout as on one device (losses, gradients, weights), with the loss the token mean of the global
batch; and a packed document trains as the document alone.

The layouts run in few process groups (one per world size: those on 4 and 8 ranks in tests/hf/test_hf.py's worlds);
the one-device references run in the test process.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lightning_hybrid.core.batch import TokenBatch, document_causal_mask
from lightning_hybrid.models import GPTLightningModule
from tests.parity import BLOCK, LORA_TOLERANCES, PARAM_ATOL, RTOL, STEPS, DocumentSamples, check_world
from tests.strategy.test_strategy_parity import gpt

pytest.importorskip("transformers")

from lightning_hybrid.hf import CausalLM  # noqa: E402
from tests.families import tiny_config  # noqa: E402
from tests.hf.attention_implementations import user_attention_lm  # noqa: E402

HF_STEPS = 4
HF_TOLERANCES = (RTOL, 1e-5)  # as tests/hf/test_hf.py: transformers families at lr 2e-4


def _lm(family: str) -> CausalLM:
    return CausalLM(tiny_config(family), lr=2e-4)


#: LoRA (peft) on every linear of the blocks, both matrices drawn at random (peft's B = 0 would leave the first
#: step's gradients of A at 0 and every norm below CLIP), alpha 8r.
LORA = {"r": 8, "lora_alpha": 32, "init_lora_weights": False, "target_modules": "all-linear"}
#: Their gradient norms: 0.4-1.3 on one device (below the GPT's `CLIP` in places; clipping must act on every step).
LORA_CLIP = {"gradient_clip_val": 0.3}


class _SGDLoraLM(CausalLM):
    """Plain SGD: under AdamW (2e-4) the same runs are 5e-6 to 6e-5 off in a later step's gradient norm -- an element
    whose gradient is near 0 (in the packed Llama run one of layer 1's query adapter, 5.9e-6 off after one step,
    every other element within 3e-8) moved by the fp32 noise of its sum through Adam's per-element normalisation,
    the sensitivity FP8's runs avoid the same way (tests/parity.py's `SGDGPT`); under SGD within the tolerances."""

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.01)


def _lora_lm(family: str, target_modules="all-linear") -> CausalLM:
    """A transformers model of ``family`` with LoRA adapters (`LORA`): the adapters alone train."""
    return _SGDLoraLM(tiny_config(family), lora={**LORA, "target_modules": target_modules})


def _assert_adapters_split(results: list[dict], name: str, make) -> None:
    """Each TP rank of run ``name`` holds fewer trainable elements than one device: the adapters were split (an
    adapter left whole would train exactly too)."""
    module = make()
    module.configure_model()
    whole = sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert all(per_run[name]["local_params"] < whole for per_run in results), name


# ---------------------------------------------------------------------------------------------- one process
def _packed_row():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, 256, (1, 9), generator=g), torch.randint(0, 256, (1, 14), generator=g)
    pad = torch.randint(0, 256, (1, 5), generator=g)
    ids = torch.cat([a, b, pad], 1)
    positions = torch.cat([torch.arange(9), torch.arange(14), torch.zeros(5, dtype=torch.long)]).unsqueeze(0)
    mask = torch.cat([torch.ones(23, dtype=torch.long), torch.zeros(5, dtype=torch.long)]).unsqueeze(0)
    return a, b, {"input_ids": ids, "position_ids": positions, "attention_mask": mask}


def _modules():
    gpt_module = GPTLightningModule(vocab_size=256, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32)
    return {"gpt": gpt_module, **{f: _lm(f) for f in ("llama", "qwen2", "gpt_neox", "gpt2", "phi3")}}


@pytest.mark.parametrize("name", ["gpt", "llama", "qwen2", "gpt_neox", "gpt2", "phi3"])
def test_a_packed_document_trains_as_the_document_alone(name):
    module = _modules()[name]
    module.configure_model()
    a, b, batch = _packed_row()
    tokens = TokenBatch.from_batch(batch)
    logits = module(tokens.input_ids, **tokens.model_inputs())
    torch.testing.assert_close(logits[:, :9], module(a), rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[:, 9:23], module(b), rtol=0, atol=1e-5)
    # The loss of one document and its gradient, packed or alone.
    labels = torch.full_like(tokens.input_ids, -100)
    labels[:, 9:22] = b[:, 1:]
    packed = module.loss_fn(logits, labels)
    grads_packed = torch.autograd.grad(packed, list(module.parameters()), allow_unused=True)
    alone = module.loss_fn(module(b), b.roll(-1, 1).masked_fill(torch.arange(14) == 13, -100))
    grads_alone = torch.autograd.grad(alone, list(module.parameters()), allow_unused=True)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    for gp, ga in zip(grads_packed, grads_alone):
        if gp is not None or ga is not None:
            torch.testing.assert_close(gp, ga, rtol=1e-5, atol=1e-6)
    # As a transformers user calls it: the mask and positions as keywords.
    # (The first packed forward of a transformers model ran its masked SDPA, verifying the per-document attention
    # that later ones run: `lightning_hybrid.hf.document_attention`; the two agree to fp32 noise.)
    direct = module(batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(direct, logits, rtol=0, atol=1e-6)
    # Changing a padding token, or another document's, changes nothing of this document.
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][:, :9] = (changed["input_ids"][:, :9] + 1) % 256
    changed["input_ids"][:, 23:] = (changed["input_ids"][:, 23:] + 7) % 256
    tokens2 = TokenBatch.from_batch(changed)
    again = module(tokens2.input_ids, **tokens2.model_inputs())
    torch.testing.assert_close(again[:, 9:23], logits[:, 9:23], rtol=0, atol=1e-6)


def test_the_batch_forms_reduce_to_positions():
    ids = torch.arange(12).view(2, 6)
    # Right padding only: plain causal attention, padding out of the loss.
    right = TokenBatch.from_batch({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1, 1, 0, 0]] * 2)})
    assert right.position_ids is None and right.labels[0].tolist() == [1, 2, 3, -100, -100, -100]
    # Left padding: positions count from the first real token; each padding token a document of its own.
    left = TokenBatch.from_batch({"input_ids": ids, "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1]] * 2)})
    assert left.position_ids[0].tolist() == [0, 0, 0, 1, 2, 3] and left.labels[0].tolist()[:2] == [-100, -100]
    mask = document_causal_mask(left.position_ids)[0, 0]
    assert mask[2:, :2].sum() == 0 and mask.diagonal().all()  # no real token sees the padding; no empty row
    # Packed documents: no label crosses a document boundary.
    packed = TokenBatch.from_batch({"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]] * 2)})
    assert packed.labels[0].tolist() == [1, 2, -100, 4, 5, -100]
    assert TokenBatch.from_batch((ids, ids)).position_ids is None
    with pytest.raises(ValueError, match=r"unknown keys \['mask'\]: valid keys are \['input_ids', 'labels'"):
        TokenBatch.from_batch({"input_ids": ids, "mask": ids})
    with pytest.raises(ValueError, match=r"labels must be a tensor of the token ids' shape \(2, 6\)"):
        TokenBatch.from_batch({"input_ids": ids, "labels": ids[:, :3]})


def test_models_whose_masks_ignore_positions_are_refused_for_packed_batches():
    module = CausalLM(tiny_config("bloom"))
    module.configure_model()
    _, _, batch = _packed_row()
    tokens = TokenBatch.from_batch(batch)
    with pytest.raises(ValueError, match="BloomForCausalLM.*train it on unpacked batches padded on the right only"):
        module(tokens.input_ids, **tokens.model_inputs())
    right = TokenBatch.from_batch({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"].flip(1)
                                   .roll(0, 1).sort(descending=True).values})
    assert right.position_ids is None
    module(right.input_ids)  # right padding alone needs no mask: accepted


def test_the_loss_is_the_token_mean_of_the_batch_on_one_device():
    samples = DocumentSamples([(torch.arange(BLOCK) % 256, (torch.arange(BLOCK) + 1) % 256)] * 4, "packed")
    items = [TokenBatch.from_batch({k: v.unsqueeze(0) for k, v in samples[i].items()}).loss_items() for i in range(4)]
    assert len(set(int(n) for n in items)) > 1  # the samples differ in loss tokens: a mean of means would differ


# ---------------------------------------------------------------------------------------------- layouts
def test_padded_and_packed_batches_match_one_device_on_2_ranks():
    references: dict = {}
    check_world(2, {
        "pp2-packed-gpt": (dict(pp=2, micro_batches=4), gpt(), {"data": "packed"}),
        "dp2-zero3-padded-gpt": (dict(dp=2, zero_stage=3), gpt(), {"data": "padded"}),
        "dp2-zero1-packed-accumulate-gpt": (dict(dp=2, zero_stage=1), gpt(), {"data": "packed",
                                                                            "accumulate_grad_batches": 2}),
        "pp2-packed-accumulate-gpt": (dict(pp=2, micro_batches=2), gpt(), {"data": "packed",
                                                                          "accumulate_grad_batches": 2}),
        # The positions reach recomputed layers: selective recompute caches the mask's ops (none in place).
        "tp2-sp-recompute-packed-gpt": (dict(tp=2, sequence_parallel=True, recompute="attention"), gpt(),
                                        {"data": "packed"}),
        "pp2-zero_bubble-checkpointed-padded-gpt": (dict(pp=2, schedule="zero_bubble", micro_batches=2,
                                                         activation_checkpointing=True), gpt(n_layer=4),
                                                    {"data": "padded"}),
    }, references=references)
    runs = {"pp2-packed-gpt2": (dict(pp=2, micro_batches=2), partial(_lm, "gpt2"), {"data": "packed"}),
            # compiled decoder layers, called by the stages: each in one graph (the harness asserts no graph break),
            # its first packed call eager and verified, its arguments computed out of its graph
            "pp2-compile-packed-llama": (dict(pp=2, micro_batches=2, compile=True), partial(_lm, "llama"),
                                         {"data": "packed"})}
    runs["dp2-zero3-padded-qwen2"] = (dict(dp=2, zero_stage=3), partial(_lm, "qwen2"), {"data": "padded"})
    # LoRA: the adapters alone reduced, sharded and stepped; TP splits them with their base layers (SP: the whole
    # A of a column layer, B of a row layer, summed over TP); pipeline stages and EP build their layers with them
    # (tests/hf/test_lora.py: what is refused, the exports).
    runs["dp2-zero3-packed-lora-llama"] = (dict(dp=2, zero_stage=3), partial(_lora_lm, "llama"),
                                           {"data": "packed", **LORA_CLIP}, LORA_TOLERANCES)
    # (Not Llama or Qwen2 on padded rows: with these adapters (scale 4, B random) that run's fourth step has layer 0's
    # attention near one-hot, and the query/key adapters' gradients 1e-5 off under any split of the sums -- pp2 and
    # cp2 alike -- where steps 1-3 are within 4e-7.)
    runs["cp2-padded-lora-phi3"] = (dict(dp=1, cp=2), partial(_lora_lm, "phi3"), {"data": "padded", **LORA_CLIP},
                                    LORA_TOLERANCES)
    runs["tp2-sp-packed-lora-llama"] = (dict(tp=2, sequence_parallel=True), partial(_lora_lm, "llama"),
                                        {"data": "packed", **LORA_CLIP}, LORA_TOLERANCES)
    runs["pp2-padded-lora-gpt_neox"] = (dict(pp=2, micro_batches=2), partial(_lora_lm, "gpt_neox"),
                                        {"data": "padded", **LORA_CLIP}, LORA_TOLERANCES)
    # (an MoE's all-linear: peft's ParamWrapper on the router's weight and on the experts' packed parameters, whose
    # adapters EP splits by expert with them)
    runs["dp2-ep2-packed-lora-olmoe"] = (dict(dp=2, ep=2), partial(_lora_lm, "olmoe"),
                                         {"data": "packed", **LORA_CLIP}, LORA_TOLERANCES)
    results = check_world(2, runs, steps=HF_STEPS, tolerances=HF_TOLERANCES)
    _assert_adapters_split(results, "tp2-sp-packed-lora-llama", partial(_lora_lm, "llama"))


# The layouts on 4 and 8 ranks run in tests/hf/test_hf.py's 4- and 8-rank worlds (one process group each for both
# files' layouts); the GPT's with the harness's own steps and tolerances.
GPT_CHECK = {"max_steps": STEPS}


def runs_on_4_ranks() -> dict:
    return {
        "dp2xtp2-sp-padded-gpt": (dict(dp=2, tp=2, sequence_parallel=True), gpt(), {"data": "padded", **GPT_CHECK},
                                  (RTOL, PARAM_ATOL)),
        # Zero bubble: the inputs' gradients and the weights' in two passes, through SP's unit backward.
        "tp2xpp2-sp-zero_bubble-packed-gpt": (dict(tp=2, pp=2, micro_batches=2, schedule="zero_bubble",
                                                   sequence_parallel=True), gpt(n_layer=4),
                                              {"data": "packed", **GPT_CHECK}, (RTOL, PARAM_ATOL)),
        "dp2xtp2-sp-packed-llama": (dict(dp=2, tp=2, sequence_parallel=True), partial(_lm, "llama"),
                                    {"data": "packed", **GPT_CHECK}, HF_TOLERANCES),
        "dp2xpp2-zero3-packed-gpt_neox": (dict(dp=2, pp=2, zero_stage=3, micro_batches=2),
                                          partial(_lm, "gpt_neox"), {"data": "packed", **GPT_CHECK}, HF_TOLERANCES),
        # An attention implementation of the user's that takes no mask (as flash_attention_2), verified on the first
        # packed batch on every rank (`VerifiedAttention`), then trained as it is.
        "tp2xpp2-sp-packed-user-attention-qwen2": (dict(tp=2, pp=2, micro_batches=2, sequence_parallel=True),
                                                   partial(user_attention_lm, "qwen2"),
                                                   {"data": "packed", **GPT_CHECK}, HF_TOLERANCES),
        # LoRA: fused projections' adapters split by their parts (Phi-3's qkv_proj, gate_up_proj) across stages.
        "tp2xpp2-sp-packed-lora-phi3": (dict(tp=2, pp=2, micro_batches=2, sequence_parallel=True),
                                        partial(_lora_lm, "phi3"),
                                        {"data": "packed", **LORA_CLIP, "max_steps": HF_STEPS}, LORA_TOLERANCES),
        "dp2xtp2-ep2-zero3-padded-lora-mixtral": (dict(dp=2, tp=2, ep=2, zero_stage=3),
                                                  partial(_lora_lm, "mixtral"),
                                                  {"data": "padded", **LORA_CLIP, "max_steps": HF_STEPS},
                                                  LORA_TOLERANCES),
    }


def runs_on_8_ranks() -> dict:
    return {
        "3d-interleaved-packed-gpt": (dict(dp=2, tp=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2,
                                           micro_batches=2, zero_stage=1), gpt(n_layer=4),
                                      {"data": "packed", **GPT_CHECK}, (RTOL, PARAM_ATOL)),
        "3d-sp-padded-qwen2": (dict(dp=2, tp=2, pp=2, micro_batches=2, sequence_parallel=True),
                               partial(_lm, "qwen2"), {"data": "padded", **GPT_CHECK}, HF_TOLERANCES),
        # LoRA on dp2 x tp2 x pp2: adapters split with their layers, across stages, reduced over DP (ZeRO-1 buckets).
        "3d-sp-zero1-packed-lora-qwen2": (dict(dp=2, tp=2, pp=2, micro_batches=2, sequence_parallel=True, zero_stage=1),
                                          partial(_lora_lm, "qwen2"),
                                          {"data": "packed", **LORA_CLIP, "max_steps": HF_STEPS}, LORA_TOLERANCES),
    }
