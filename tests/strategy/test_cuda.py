"""On a CUDA device (skipped without one): every path one GPU can run, each a small model and a few steps.

- bf16-mixed training of the reference GPT and of a `transformers` Llama (`CausalLM`) under `HybridStrategy()`,
  against the same run in fp32; the live-tensor peak of `PeakMemoryMonitor` against
  ``torch.cuda.max_memory_allocated`` (the allocator rounds blocks up and keeps library workspaces, so it can
  only be higher);
- activation checkpointing, full and selective (``recompute="attention"``: the fused SDPA kernels CUDA runs), as
  the run without it, with a lower peak for full recompute;
- sharded checkpoints on the GPU: a `ModelCheckpoint` save, an exact resume, consolidation to one plain file and
  ``load_from_checkpoint`` of the folder;
- a pretrained folder loaded, trained, exported with `export_pretrained` and reloaded by
  ``AutoModelForCausalLM.from_pretrained``: the same logits;
- ``HybridStrategy(compile=True)`` (``torch.compile`` of each decoder block) trains as eager does;
- ring attention's kernel for one chunk pair (SDPA's memory-efficient kernel with a mask, its log-sum-exp and
  backward) against explicit fp32 scores;
- the initial weights of a module built under ``Trainer(accelerator="cuda")`` (where Lightning makes the CUDA
  device the ambient one) are those it has when built on the CPU: a CPU ``torch.Generator`` drawing into a tensor
  created on the ambient CUDA device is the bug class this catches.

Several ranks on the one GPU (gloo) are `benchmarks/gpu_check.py`'s section (c), not tests here.
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hybrid import HybridStrategy
from lightning_hybrid.data.corpus import ByteCorpusDataModule
from lightning_hybrid.models import GPTConfig, GPTLightningModule
from lightning_hybrid.runs.memory import PeakMemoryMonitor
from tests.helpers import QUIET_TRAINER

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 6
BLOCK, BATCH = 256, 8
GPT_FIELDS = dict(vocab_size=256, block_size=BLOCK, n_layer=4, n_head=4, n_kv_head=2, n_embd=256, mlp="swiglu",
                  dropout=0.0)
# A small Llama (GQA, RMSNorm, rotary, SwiGLU), random init from a config, byte vocabulary, untied head.
LLAMA_FIELDS = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    intermediate_size=512, vocab_size=256, max_position_embeddings=BLOCK, tie_word_embeddings=False)


def _gpt() -> GPTLightningModule:
    return GPTLightningModule(config=GPTConfig(**GPT_FIELDS))


def _llama():
    pytest.importorskip("transformers")
    from lightning_hybrid.hf import CausalLM

    return CausalLM("llama", config=LLAMA_FIELDS, lr=1e-3, attn_implementation="sdpa")


MODELS = {"gpt": _gpt, "llama": _llama}


def _data() -> ByteCorpusDataModule:
    return ByteCorpusDataModule(max_bytes=400_000, block_size=BLOCK, batch_size=BATCH)


class Losses(L.Callback):
    """The training loss of every step (a host sync per step: tests only)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.values.append(trainer.callback_metrics["train_loss"].item())


class InitialState(L.Callback):
    """The module's state when training starts (after the strategy's setup), copied to the CPU."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.device = next(pl_module.parameters()).device
        self.state = {k: v.detach().to(device="cpu", copy=True) for k, v in pl_module.state_dict().items()}


class PeakDuringTraining(L.Callback):
    """``torch.cuda.max_memory_allocated`` from the start of training to its end (setup excluded)."""

    def on_train_start(self, trainer, pl_module) -> None:
        torch.cuda.synchronize(pl_module.device)
        torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_end(self, trainer, pl_module) -> None:
        torch.cuda.synchronize(pl_module.device)
        self.bytes = torch.cuda.max_memory_allocated(pl_module.device)


def _fit(make_module, strategy=None, precision: str = "bf16-mixed", steps: int = STEPS, callbacks=(), ckpt_path=None,
         **trainer_kwargs):
    """Train ``make_module()`` on the GPU; return ``(trainer, module, losses)``."""
    L.seed_everything(0, verbose=False)
    module = make_module()
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cuda", devices=1, precision=precision, strategy=HybridStrategy() if strategy is None else strategy,
        max_steps=steps, callbacks=[losses, *callbacks],
        **{"limit_val_batches": 0, "num_sanity_val_steps": 0, **QUIET_TRAINER, **trainer_kwargs},
    )
    trainer.fit(module, _data(), ckpt_path=ckpt_path)
    return trainer, module, losses.values


def _assert_trains(losses: list[float], steps: int = STEPS) -> None:
    assert len(losses) == steps and all(torch.isfinite(torch.tensor(losses)).tolist()), losses
    assert sum(losses[-2:]) / 2 < losses[0], f"the loss did not fall: {losses}"


# ---------------------------------------------------------------------------------------------- bf16
def test_bf16_on_one_gpu_and_peak_memory_against_the_allocator():
    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(config=GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=256,
                                                 mlp="swiglu"))
    memory = PeakMemoryMonitor(steps=3)
    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", strategy=HybridStrategy(), max_steps=5,
                        limit_val_batches=0, callbacks=[memory], **QUIET_TRAINER)
    trainer.fit(module, ByteCorpusDataModule(max_bytes=200_000, block_size=128, batch_size=4))
    params = sum(p.numel() for p in module.parameters())
    states = sum(memory.peak.breakdown[k] for k in ("parameters", "gradients", "optimizer_state"))
    # fp32 master weights and Adam's two moments, and the gradients as far as backward has made them at the peak.
    assert 12 * params * 0.95 <= states <= 16 * params * 1.1
    assert 0.5 * memory.peak.cuda_max_allocated <= memory.peak.total <= 1.02 * memory.peak.cuda_max_allocated


@pytest.mark.parametrize("model", sorted(MODELS))
def test_bf16_mixed_trains_as_fp32_does(model):
    """bf16-mixed under `HybridStrategy()` (and validation on the GPU) follows the fp32 run within bf16's error."""
    trainer, module, bf16 = _fit(MODELS[model], limit_val_batches=2, val_check_interval=STEPS)
    assert next(module.parameters()).device.type == "cuda"
    assert next(module.parameters()).dtype == torch.float32  # fp32 master weights under autocast
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    _, _, fp32 = _fit(MODELS[model], precision="32-true")
    _assert_trains(bf16)
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=5e-2, atol=0)


# ---------------------------------------------------------------------------------------------- recompute
@functools.lru_cache(maxsize=None)
def _without_checkpointing(model: str) -> tuple[list[float], int]:
    peak = PeakDuringTraining()
    _, _, losses = _fit(MODELS[model], callbacks=[peak])
    return losses, peak.bytes


@pytest.mark.parametrize("recompute", ["full", "attention"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_activation_checkpointing_trains_as_without(model, recompute):
    reference, reference_peak = _without_checkpointing(model)
    peak = PeakDuringTraining()
    _, module, losses = _fit(MODELS[model], HybridStrategy(activation_checkpointing=True, recompute=recompute),
                             callbacks=[peak])
    checkpointed = [n for n, m in module.named_modules() if getattr(m, "_activation_checkpointed", False)]
    layers = GPT_FIELDS["n_layer"] if model == "gpt" else LLAMA_FIELDS["num_hidden_layers"]
    assert len(checkpointed) == layers, checkpointed
    _assert_trains(losses)
    # The recomputation runs the forward's kernels again on the same inputs; only backward's reduction order differs.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-2, atol=0)
    if recompute == "full":
        assert peak.bytes < 0.9 * reference_peak, (peak.bytes, reference_peak)
    else:
        assert peak.bytes <= 1.05 * reference_peak, (peak.bytes, reference_peak)


# ---------------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_save_resume_and_consolidation_on_the_gpu(tmp_path):
    from lightning_hybrid.checkpoint import consolidate

    _, _, full = _fit(_gpt, precision="32-true")
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_last=True, save_top_k=-1)
    trainer, _, first = _fit(_gpt, precision="32-true", steps=3, callbacks=[saves], enable_checkpointing=True)
    saved = {k: v.to(device="cpu") for k, v in trainer.strategy.full_state_dict().items()}
    ckpt = tmp_path / "last.ckpt"
    assert ckpt.is_dir() and (tmp_path / "epoch=0-step=3.ckpt").is_dir(), sorted(p.name for p in tmp_path.iterdir())
    # the same run up to the save
    torch.testing.assert_close(torch.tensor(first), torch.tensor(full[:3]), rtol=1e-4, atol=0)
    _, _, resumed = _fit(_gpt, precision="32-true", ckpt_path=str(ckpt))
    assert len(resumed) == STEPS - 3
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[3:]), rtol=1e-4, atol=0)

    plain = consolidate(ckpt, tmp_path / "plain.pt")  # one process, read on the CPU
    assert plain.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(plain[key], value, rtol=0, atol=0, msg=key)
    loaded = GPTLightningModule.load_from_checkpoint(ckpt, map_location="cpu")
    for key, value in saved.items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0, msg=key)


class FinalLogits(L.Callback):
    """The trained module's fp32 logits for ``ids`` (outside autocast), on the CPU."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def on_train_end(self, trainer, pl_module) -> None:
        pl_module.eval()
        with torch.no_grad():
            self.logits = pl_module(self.ids.to(pl_module.device)).float().to(device="cpu")


def test_pretrained_load_train_export_and_reload_on_the_gpu(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lightning_hybrid.hf import CausalLM, export_pretrained

    with torch.device("cpu"), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        source = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA_FIELDS)).float()
    source.save_pretrained(tmp_path / "in")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator(device="cpu").manual_seed(2), device="cpu")
    initial, final = InitialState(), FinalLogits(ids)
    trainer, module, losses = _fit(lambda: CausalLM(str(tmp_path / "in"), lr=1e-3, attn_implementation="sdpa"),
                                   callbacks=[initial, final])
    _assert_trains(losses)
    assert initial.device.type == "cuda"
    for name, value in source.state_dict().items():  # the folder's weights, as they are, on the GPU
        torch.testing.assert_close(initial.state[f"model.{name}"], value, rtol=0, atol=0, msg=name)

    export_pretrained(trainer, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                                 attn_implementation="sdpa").float().eval()
    trained = {k: v.to(device="cpu") for k, v in module.state_dict().items()}
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trained[f"model.{name}"], rtol=0, atol=0, msg=name)
    assert not torch.equal(reloaded.model.embed_tokens.weight, source.model.embed_tokens.weight), (
        "the exported model was trained")
    reloaded.to(initial.device)
    with torch.no_grad():
        logits = reloaded(input_ids=ids.to(initial.device)).logits.to(device="cpu")
    torch.testing.assert_close(logits, final.logits, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- compile
def _dynamo_counts() -> tuple[int, int]:
    """How many graphs torch.compile has made in this process, and how many graph breaks it met."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.parametrize("model", sorted(MODELS))
def test_compiled_blocks_train_as_eager(model):
    _, _, eager = _fit(MODELS[model])
    graphs_before, breaks_before = _dynamo_counts()
    _, _, compiled = _fit(MODELS[model], HybridStrategy(compile=True))
    graphs, breaks = (now - before for now, before in zip(_dynamo_counts(), (graphs_before, breaks_before)))
    assert graphs > 0 and breaks == 0, f"the blocks ran in {graphs} compiled graphs with {breaks} graph breaks"
    _assert_trains(compiled)
    # Inductor fuses and reorders bf16 arithmetic: a loose tolerance.
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=2e-2, atol=0)


# ---------------------------------------------------------------------------------------------- initialisation
@pytest.mark.parametrize("strategy", ["hybrid", "auto"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_initial_weights_built_under_a_cuda_trainer_are_the_cpu_ones(model, strategy):
    """Lightning builds the module (``configure_model``) with the CUDA device as the ambient one; the weights must
    be those the same seed gives on the CPU."""
    on_cpu = MODELS[model]()
    with torch.device("cpu"):
        on_cpu.configure_model()
    want = {k: v.detach() for k, v in on_cpu.state_dict().items()}
    initial = InitialState()
    _fit(MODELS[model], HybridStrategy() if strategy == "hybrid" else "auto", precision="32-true", steps=1,
         callbacks=[initial])
    assert initial.device.type == "cuda"
    assert initial.state.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(initial.state[key], value, rtol=0, atol=0, msg=key)


# ---------------------------------------------------------------------------------------------- ring attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_attentions_cuda_kernel_is_the_explicit_attention_of_a_chunk_pair(dtype):
    """`cp_attention="ring"` attends each chunk pair with SDPA's memory-efficient kernel on CUDA (a mask, the
    log-sum-exp): against the explicit fp32 scores on the same inputs (`tests/context_expert/ring_kernels.py`)."""
    from tests.context_expert.ring_kernels import pair_kernel_errors

    errors = pair_kernel_errors("cuda", dtype)
    assert max(errors.values()) < (1e-4 if dtype == torch.float32 else 2e-2), errors
