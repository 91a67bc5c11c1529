"""Mixture-of-experts models of `transformers`: the router's load-balancing loss, as the model's own training adds it,
over the whole data-parallel batch -- equal to the model's own loss on one device, and every layout equal to one
device (the loss is a product of batch-wide means: a rank's share of the batch alone would give another one)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

from lightning_hybrid.core.batch import TokenBatch
from lightning_hybrid.models import GPTConfig, GPTLightningModule
from tests.parity import BLOCK, RTOL, check_world

pytest.importorskip("transformers")

from lightning_hybrid.hf import CausalLM  # noqa: E402
from lightning_hybrid.hf.moe import gather_rows  # noqa: E402
from lightning_hybrid.parallel.expert_parallel import find_experts  # noqa: E402
from lightning_hybrid.testing import run_distributed  # noqa: E402
from tests.families import tiny_config  # noqa: E402

MOE_FAMILIES = ("mixtral", "olmoe", "qwen3_moe", "gpt_oss")
HF_STEPS = 4
HF_TOLERANCES = (RTOL, 1e-5)


def _lm(family: str) -> CausalLM:
    return CausalLM(tiny_config(family), lr=2e-4)


def _padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (3, 16), generator=g)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[1, 11:] = 0
    mask[2, 7:] = 0  # right padding: transformers' own call needs no positions
    return ids, mask


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_loss_is_the_models_own_with_its_load_balancing_loss(family):
    module = _lm(family)
    module.configure_model()
    module.train()
    assert module._aux is not None and module._aux.coef == 0.5
    ids, mask = _padded_batch()
    tokens = TokenBatch.from_batch({"input_ids": ids, "attention_mask": mask})
    loss = module.loss_fn(module(tokens.input_ids, **tokens.model_inputs()), tokens.labels)
    term, value = module.auxiliary_loss(tokens)
    # transformers' own: labels unshifted, padding ignored, the aux loss over the real tokens (attention_mask).
    own = module.model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    torch.testing.assert_close(value, own.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(loss + term, own.loss, rtol=1e-6, atol=0)
    assert float(term.detach()) > 0.5  # large enough that a wrong one shows in the layouts below


def test_models_without_a_load_balancing_loss_have_none():
    import transformers as T

    config = tiny_config("mixtral")
    config.output_router_logits = False
    module = CausalLM(config)
    module.configure_model()
    assert module._aux is None
    # DeepSeek-V3 records router logits but balances its experts by a bias: its training adds no loss.
    deepseek = T.DeepseekV3Config(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                  n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                  first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8, output_router_logits=True,
                                  max_position_embeddings=64)
    module = CausalLM(deepseek)
    module.configure_model()
    assert module._aux is None


# ---------------------------------------------------------------------------------------------- layouts
def _gather_and_refuse() -> dict:
    """On 2 ranks: `gather_rows` of uneven pieces and its gradient; a pipeline schedule that cannot compute the
    load-balancing loss exactly, refused before it starts."""
    from lightning_hybrid import HybridStrategy
    from tests.parity import fit_and_record

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.arange(3 + rank * 2, dtype=torch.float64).unsqueeze(1).repeat(1, 2).requires_grad_()
    gathered = gather_rows(x, dist.group.WORLD)
    weights = torch.arange(gathered.numel(), dtype=torch.float64).view_as(gathered) * (rank + 1)
    (gathered * weights).sum().backward()
    out = {"gathered": gathered.detach(), "grad": x.grad}
    try:
        fit_and_record(HybridStrategy(pp=2, micro_batches=2, schedule="1f1b"), 2, partial(_lm, "mixtral"), steps=1)
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_gather_rows_and_the_pipeline_refusal_on_2_ranks():
    results = run_distributed(_gather_and_refuse, 2)
    expected = torch.cat([torch.arange(3, dtype=torch.float64), torch.arange(5, dtype=torch.float64)])
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["gathered"][:, 0], expected)
        # Rank r's rows get the sum over the ranks of their weights: (1 + 2) * their index in the gathered rows.
        start = 0 if rank == 0 else 3
        index = torch.arange(out["grad"].numel(), dtype=torch.float64).view_as(out["grad"]) + 2 * start
        torch.testing.assert_close(out["grad"], 3 * index)
        refused = out.get("refused", "")
        assert "schedule='gpipe'" in refused and "'1f1b'" in refused, refused


def _batch_mean_gpt() -> "_BatchMeanGPT":
    config = GPTConfig(vocab_size=256, block_size=BLOCK, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp="swiglu")
    return _BatchMeanGPT(config=config, lr=5e-4, weight_decay=0.1)


class _BatchMeanGPT(GPTLightningModule):
    """Any LightningModule with an auxiliary loss of the whole batch (`PipelineAuxLoss`): the squared batch mean of
    each block's ``ln_2`` output, a product of batch means as the load-balancing loss is. On one device its
    training step adds the loss itself, from its own hooks; under pp > 1 the strategy computes it."""

    def configure_model(self) -> None:
        super().configure_model()
        self._seen: list[torch.Tensor] = []
        for layer in self.pipeline_layers():
            for source, _ in self.pipeline_aux_sources(layer):
                source.register_forward_hook(self._see)

    def _see(self, module, args, output) -> None:
        if self.training and torch.is_grad_enabled():
            self._seen.append(output)

    def pipeline_aux_sources(self, layer):
        return [(layer.ln_2, None)] if hasattr(layer, "ln_2") else []

    def pipeline_aux_loss(self, outputs):
        return sum((x.float().mean(dim=(0, 1)) ** 2).sum() for x in outputs) * 10.0

    def auxiliary_loss(self, tokens):
        seen, self._seen = self._seen, []
        mesh = self._device_mesh
        if mesh is not None and mesh["pp"].size() > 1:  # in the pipeline's loss already
            return None
        assert self._device_mesh is None or mesh.size() == 1, "this test module computes the loss on one device"
        term = self.pipeline_aux_loss(seen)
        return term, term.detach()


# ---------------------------------------------------------------------------------------------- expert parallelism
def test_load_balancing_loss_and_expert_parallel_layouts_match_one_device_on_4_ranks():
    """The load-balancing loss over the global batch (DP; DP x TP under SP; accumulation: each batch's; PP under
    GPipe, any module's through `PipelineAuxLoss`), and the experts split over ep ranks of DP (edp 2 or 1), with
    ZeRO 0-3, TP, SP, PP and activation checkpointing."""
    results = check_world(4, {
        "dp4-ep2-zero1-padded-olmoe": (dict(dp=4, ep=2, zero_stage=1), partial(_lm, "olmoe"), {"data": "padded"}),
        "dp4-ep4-gpt_oss": (dict(dp=4, ep=4), partial(_lm, "gpt_oss"), {}),  # experts with biases
        "dp2xtp2-ep2-deepseek_v3": (dict(dp=2, tp=2, ep=2), partial(_lm, "deepseek_v3"), {}),  # + shared expert
        "dp2xtp2-ep2-zero3-padded-qwen3_moe": (dict(dp=2, tp=2, ep=2, zero_stage=3), partial(_lm, "qwen3_moe"),
                                               {"data": "padded"}),
        "dp2xtp2-sp-ep2-packed-olmoe": (dict(dp=2, tp=2, ep=2, sequence_parallel=True), partial(_lm, "olmoe"),
                                        {"data": "packed"}),
        # Accumulated: each batch's loss over its global batch, as one device accumulating the same batches.
        "dp2xtp2-ep2-zero2-accumulate-mixtral": (dict(dp=2, tp=2, ep=2, zero_stage=2), partial(_lm, "mixtral"),
                                                 {"accumulate_grad_batches": 2}),
        "dp4-ep2-zero3-checkpointed-qwen3_moe": (dict(dp=4, ep=2, zero_stage=3, activation_checkpointing=True),
                                                 partial(_lm, "qwen3_moe"), {}),
        # Selective recompute: the routers divide topk's weights in place (Mixtral; DeepSeek-V3 also scales them),
        # which a selective checkpoint cannot keep -- the layer learns to recompute topk at its first forward.
        "dp4-ep2-pointwise-mixtral": (dict(dp=4, ep=2, recompute="pointwise"), partial(_lm, "mixtral"), {}),
        "dp2xtp2-ep2-attention-deepseek_v3": (dict(dp=2, tp=2, ep=2, recompute="attention"),
                                              partial(_lm, "deepseek_v3"), {}),
        # Pipelines (GPipe, the default schedule for such a model): the loss of every layer and micro-batch,
        # exchanged between the forwards and the backwards.
        "dp2xpp2-ep2-default-schedule-padded-olmoe": (dict(dp=2, pp=2, ep=2, micro_batches=2),
                                                      partial(_lm, "olmoe"), {"data": "padded"}),
        "dp2xpp2-zero3-checkpointed-gpipe-qwen3_moe": (dict(dp=2, pp=2, zero_stage=3, activation_checkpointing=True,
                                                            micro_batches=2, schedule="gpipe"),
                                                       partial(_lm, "qwen3_moe"), {}),
        "tp2xpp2-gpipe-accumulate-mixtral": (dict(tp=2, pp=2, micro_batches=2, schedule="gpipe"),
                                             partial(_lm, "mixtral"), {"accumulate_grad_batches": 2}),
        "dp2xpp2-zero1-gpipe-batch-mean-gpt": (dict(dp=2, pp=2, zero_stage=1, micro_batches=2, schedule="gpipe"),
                                               _batch_mean_gpt, {}),
    }, steps=HF_STEPS, tolerances=HF_TOLERANCES)
    # Each rank holds 1/ep of every experts module's parameters.
    for name, family, ep in (("dp4-ep2-zero1-padded-olmoe", "olmoe", 2), ("dp4-ep4-gpt_oss", "gpt_oss", 4),
                             ("dp2xtp2-ep2-zero2-accumulate-mixtral", "mixtral", 2)):
        module = _lm(family)
        module.configure_model()
        whole = sum(p.numel() for _, experts in find_experts(module) for p in experts.parameters())
        assert whole > 0
        for per_run in results:
            assert per_run[name]["expert_params"] * ep == whole, (name, per_run[name]["expert_params"], whole)


_EP_LAYOUTS = {"ep4-zero3": dict(dp=4, ep=4, zero_stage=3), "ep1-dp2xtp2": dict(dp=2, tp=2)}


def _checkpoints(ckpt: str) -> dict:
    from tests.strategy.test_checkpoint import fit_and_resume

    return fit_and_resume(ckpt, dict(dp=4, ep=2, zero_stage=1), _EP_LAYOUTS, partial(_lm, "mixtral"))


def test_expert_parallel_checkpoints_resume_exactly_under_other_ep_on_4_ranks(tmp_path):
    from lightning_hybrid.checkpoint import consolidated_state_dict, read_meta
    from tests.strategy.test_checkpoint import assert_resumed_exactly

    ckpt = str(tmp_path / "step4.ckpt")
    by_rank = run_distributed(_checkpoints, 4, ckpt)
    assert read_meta(ckpt)["lightning_hybrid"]["layout"]["ep"] == 2
    whole = consolidated_state_dict(ckpt)  # the experts saved whole: (num_experts, ...)
    assert whole["model.model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4
    assert_resumed_exactly(by_rank, _EP_LAYOUTS)


class _ReadsRecorded(CausalLM):
    """CausalLM whose folder reads are recorded (key, dim, start, length): which expert rows a rank reads."""

    def configure_model(self) -> None:
        super().configure_model()
        weights = self._weights
        if weights is not None and not hasattr(weights, "reads"):
            reads: list = []
            read = weights.read

            def recorded(key, dim=None, start=0, length=0):
                reads.append((key, dim, start, length))
                return read(key, dim, start, length)

            weights.read, weights.reads = recorded, reads


def _pretrained_experts(folder: str) -> dict:
    """dp2 ep2 from a pretrained folder, one step at lr 0: each rank's experts are the folder's rows of its experts."""
    import lightning as L

    from lightning_hybrid import HybridStrategy
    from lightning_hybrid.data.corpus import ByteCorpusDataModule
    from tests.helpers import QUIET_TRAINER

    module = _ReadsRecorded(folder, lr=0.0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(dp=2, ep=2), max_steps=1,
                        **{**QUIET_TRAINER, "limit_val_batches": 0})
    trainer.fit(module, ByteCorpusDataModule(max_bytes=20_000, block_size=16, batch_size=2))
    return {"reads": [r for r in module._weights.reads if ".experts." in r[0]], "deferred": module.layers_deferred,
            "experts": {n: p.detach().clone() for n, p in module.named_parameters() if ".experts." in n}}


def test_each_expert_parallel_rank_reads_only_its_experts_from_a_pretrained_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    # save_pretrained's folder: one tensor per expert (experts.0.w1.weight ...), which transformers' loader stacks
    # into the model's packed tensors, as CausalLM does (tests/hf/test_expert_folders.py).
    config = tiny_config("mixtral")
    config.output_router_logits = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "model")
    packed = model.state_dict()
    for rank, out in enumerate(run_distributed(_pretrained_experts, 2, str(tmp_path / "model"))):
        assert out["deferred"] and out["reads"], rank
        # Only rows [2 * rank, 2 * rank + 2) of each (4, ...) experts tensor were read ...
        assert all(dim == 0 and start == 2 * rank and length == 2 for _, dim, start, length in out["reads"]), out
        # ... and they are this rank's experts.
        for name, value in out["experts"].items():
            torch.testing.assert_close(value, packed[name.removeprefix("model.")][2 * rank: 2 * rank + 2])
