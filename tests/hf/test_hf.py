"""`lightning_hybrid.hf.CausalLM`: Hugging Face causal LMs (random init from a config; nothing downloaded)
under pipeline layouts against the same module on one process, the refusals, and pretrained folders in and out."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("transformers")

import lightning as L  # noqa: E402
import transformers as T  # noqa: E402

from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.data.corpus import ByteCorpusDataModule  # noqa: E402
from lightning_hybrid.hf import CausalLM, PipelineDecompositionError, export_pretrained, pipeline_structure  # noqa: E402
from lightning_hybrid.parallel.pipeline.stages import keep_local_layers, plan_stages  # noqa: E402
from lightning_hybrid.runs.memory import LiveTensorTracker  # noqa: E402
from tests.families import tiny_config  # noqa: E402
from tests.helpers import QUIET_TRAINER, run_distributed, storage_bytes  # noqa: E402
from tests.hf.test_finetune_parity import runs_on_4_ranks, runs_on_8_ranks  # noqa: E402
from tests.parity import RTOL, check_world  # noqa: E402

FAMILIES = ("llama", "qwen2", "gpt_neox", "gpt2")
# Adam turns a gradient at the scale of its eps into an update of order lr, so fp32 reordering noise in such a
# gradient moves one element by ~2% of lr (see test_tensor_parallel_models): lr * 0.02 < 1e-5.
LR = 2e-4
STEPS = 4
# Measured: parameters within 3.1e-6 of one device (gpt_neox), losses and norms within 2.6e-7 relative.
TOLERANCES = (RTOL, 1e-5)


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
    assert (names[:2] == ["gpt_neox.embed_in", "gpt_neox.emb_dropout"]
            and names[-2:] == ["gpt_neox.final_layer_norm", "lm_head"])


def test_same_init_on_every_layout_and_a_seed_of_its_own():
    a, b = _built(tiny_config("llama")), _built(tiny_config("llama"))
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    c = CausalLM(tiny_config("llama"), init_seed=1)
    c.configure_model()
    assert not torch.equal(a.model.model.embed_tokens.weight, c.model.model.embed_tokens.weight)


def test_models_the_layers_cannot_reproduce_are_refused():
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, vocab_size=256, head_dim=8, tie_word_embeddings=False)
    with pytest.raises(PipelineDecompositionError, match="after its last decoder layer"):  # logit soft-capping
        _built(T.Gemma2Config(**small, final_logit_softcapping=30.0)).pipeline_layers()
    # OPT's offset positions
    with pytest.raises(PipelineDecompositionError, match="cannot be cut into pipeline layers exactly"):
        _built(T.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, vocab_size=256,
                           tie_word_embeddings=False)).pipeline_layers()
    with pytest.raises(ValueError, match="model='/no/such/folder' is neither a local folder"):
        CausalLM("/no/such/folder")
    with pytest.raises(PipelineDecompositionError, match="tie_word_embeddings=False"):
        _built(T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=256)).pipeline_layers()


def test_without_a_pipeline_nothing_is_refused():
    """Activation checkpointing at pp=1 picks the decoder layers and leaves the pipeline decomposition alone:
    a model it would refuse (tied embeddings) trains there."""
    from lightning_hybrid.parallel.activation_checkpointing import checkpoint_targets

    module = _built(T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=256))
    assert checkpoint_targets(module, True) == ["model.transformer.h.0", "model.transformer.h.1"]


# ---------------------------------------------------------------------------------------------- layouts
def _no_rank_holds_the_whole_model(results: list[dict], references: dict) -> None:
    for rank, per_run in enumerate(results):
        for name, got in per_run.items():
            assert got["param_bytes"] < references[name]["param_bytes"], f"{name}: rank {rank} holds the whole model"


def test_families_under_pipeline_layouts_match_one_device():
    runs = {f"pp2-{family}": (dict(pp=2, micro_batches=2), partial(_lm, family), {}) for family in FAMILIES}
    runs["pp2-recompute-llama"] = (
        dict(pp=2, micro_batches=2, activation_checkpointing=True), partial(_lm, "llama"), {})
    runs["pp2-interleaved-gpt_neox"] = (
        dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2, micro_batches=2), partial(_lm, "gpt_neox"), {})
    references: dict = {}
    _no_rank_holds_the_whole_model(
        check_world(2, runs, steps=STEPS, references=references, tolerances=TOLERANCES), references)


def test_families_under_tp_pp_and_3d_layouts_match_one_device():
    runs = {f"tp2xpp2-{family}": (dict(tp=2, pp=2, micro_batches=2), partial(_lm, family), {})
            for family in ("llama", "qwen2", "gpt2")}
    # pp=1: the model stays on the meta device and each rank initialises one layer at a time, keeping its slices.
    runs["dp2xtp2-zero3-gpt_neox"] = (dict(dp=2, tp=2, zero_stage=3), partial(_lm, "gpt_neox"), {})
    runs["tp2xpp2-sp-gpt2"] = (dict(tp=2, pp=2, micro_batches=2, sequence_parallel=True), partial(_lm, "gpt2"), {})
    # transformers' decoder layers compiled (TorchTitan's per-block torch.compile), TP-split and FSDP2-sharded.
    runs["dp2xtp2-zero3-compile-llama"] = (dict(dp=2, tp=2, zero_stage=3, compile=True), partial(_lm, "llama"), {})
    runs.update(runs_on_4_ranks())  # padded and packed batches, LoRA (tests/hf/test_finetune_parity.py)
    references: dict = {}
    _no_rank_holds_the_whole_model(
        check_world(4, runs, steps=STEPS, references=references, tolerances=TOLERANCES), references)
    runs = {
        f"dp2xtp2xpp2-zero{stage}-{family}": (
            dict(dp=2, tp=2, pp=2, zero_stage=stage, micro_batches=2), partial(_lm, family), {})
        for stage, family in ((1, "gpt_neox"), (3, "llama"))
    }
    runs["dp2xtp2xpp2-zero1-sp-qwen2"] = (
        dict(dp=2, tp=2, pp=2, zero_stage=1, micro_batches=2, sequence_parallel=True), partial(_lm, "qwen2"), {})
    runs.update(runs_on_8_ranks())
    _no_rank_holds_the_whole_model(
        check_world(8, runs, steps=STEPS, references=references, tolerances=TOLERANCES), references)


# ---------------------------------------------------------------------------------------------- pretrained
class FinalLogits(L.Callback):
    """The trained model's logits for ``ids``: ``self(x)`` through the stages, on every rank."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def on_train_end(self, trainer, pl_module):
        pl_module.eval()
        with torch.no_grad():
            self.logits = pl_module(self.ids)


def _train_load_export(folder: str, out: str, ids: torch.Tensor) -> dict:
    L.seed_everything(0, verbose=False)
    module = CausalLM(folder, lr=1e-3)
    final = FinalLogits(ids)
    trainer = L.Trainer(accelerator="cpu", devices=8, max_steps=2, limit_val_batches=0, num_sanity_val_steps=0,
                        strategy=HybridStrategy(dp=2, tp=2, pp=2, zero_stage=1, micro_batches=2), callbacks=[final],
                        **QUIET_TRAINER)
    trainer.fit(module, ByteCorpusDataModule(max_bytes=20_000, block_size=16, batch_size=2))
    param_bytes = storage_bytes(module.parameters())
    export_pretrained(trainer, out, max_shard_bytes=50_000)  # a few shards and their index
    try:  # rank 0 cannot write its first shard there: every rank raises, none waits for it
        export_pretrained(trainer, f"{out}-blocked")
        blocked = "no error"
    except Exception as e:
        blocked = f"{type(e).__name__}: {e}"
    return {"logits": final.logits, "param_bytes": param_bytes, "blocked": blocked}


def test_pretrained_folder_in_and_out_under_3d(tmp_path):
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_config(tiny_config("llama")).float()
    source.save_pretrained(tmp_path / "in")
    whole = sum(p.numel() * p.element_size() for p in source.parameters())
    # One process: the folder's weights, as they are.
    loaded = _built(str(tmp_path / "in"))
    for name, value in source.state_dict().items():
        torch.testing.assert_close(loaded.model.state_dict()[name], value, rtol=0, atol=0, msg=name)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    (tmp_path / "out-blocked" / ".shard-0.safetensors").mkdir(parents=True)  # a folder where rank 0 writes a file
    results = run_distributed(_train_load_export, 8, str(tmp_path / "in"), str(tmp_path / "out"), ids)
    error = "SafetensorError: Error while serializing: I/O error: Is a directory"
    assert results[0]["blocked"].startswith(error), results[0]["blocked"]
    assert all(r["blocked"].startswith(f"RuntimeError: rank 0 failed in export_pretrained: {error}")
               for r in results[1:]), [r["blocked"] for r in results]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    with torch.no_grad():
        want = reloaded(input_ids=ids).logits
    assert not torch.allclose(want, source(input_ids=ids).logits, atol=1e-4), "the exported model was trained"
    assert (len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
            and (tmp_path / "out" / "model.safetensors.index.json").exists())
    again = _built(str(tmp_path / "out")).eval()  # CausalLM reads a sharded folder too
    with torch.no_grad():
        torch.testing.assert_close(again(ids), want, rtol=0, atol=0)
    for rank, got in enumerate(results):
        torch.testing.assert_close(got["logits"], want, rtol=0, atol=1e-5, msg=f"rank {rank}: logits")
        assert got["param_bytes"] < whole / 2, f"rank {rank} holds {got['param_bytes']} of {whole} bytes"


def test_a_pretrained_load_reads_only_the_ranks_layers(tmp_path):
    """The peak of live tensor bytes while a pipeline rank materialises its layers from the folder: those
    layers plus one tensor being read, never the whole model."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_config("llama")).float().save_pretrained(tmp_path)
    whole = _built(str(tmp_path))
    whole_bytes = storage_bytes(whole.parameters())
    module = CausalLM(str(tmp_path))
    with torch.device("meta"):  # the strategy's init context under pp > 1: layers are built per rank
        module.configure_model()
    layout = plan_stages(module, pp=2, pp_rank=1, stages_per_rank=1, style="loop", split_points=None)
    with LiveTensorTracker("cpu") as tracker:
        keep_local_layers(module, layout, torch.device("cpu"))
    local = storage_bytes(module.parameters())
    largest = max(p.numel() * 4 for p in whole.parameters())
    assert local < 0.6 * whole_bytes
    assert tracker.peak <= local + largest, (tracker.peak, local, largest, whole_bytes)
    for name, value in module.model.named_parameters():  # what was read is the folder's
        torch.testing.assert_close(value, whole.model.get_parameter(name), rtol=0, atol=0, msg=name)


class _SetupPeak(L.Callback):
    """The peak of live tensor bytes from the module's construction to the first step (``setup``), the peak while
    the strategy materialises the TP-split layers (``load_peak``, above the live bytes when that started), and the
    unsplit weights after setup (gathered over TP, ZeRO-3 and the stages)."""

    def setup(self, trainer, pl_module, stage):
        self.tracker = LiveTensorTracker("cpu")
        self.tracker.__enter__()
        self.load_peak = self.before_load_peak = None

    def load(self, materialise):
        """``materialise`` (`parallelize`'s `materialise_split_layers`) with its own peak window."""

        def measured(*args):
            self.before_load_peak = self.tracker.peak  # construction, TP plan and verification
            self.tracker.reset_peak()
            start = self.tracker.total
            materialise(*args)
            self.load_peak = self.tracker.peak - start

        return measured

    def on_fit_start(self, trainer, pl_module):
        self.tracker.__exit__(None, None, None)
        self.peak = max(self.tracker.peak, self.before_load_peak or 0)
        self.full = {k.removeprefix("model."): v for k, v in trainer.strategy.full_state_dict().items()}


def _load_under(folder: str, layouts: dict) -> dict:
    """Per layout: setup's peak, the TP load's peak (above what was live before it), this rank's TP-local
    parameter bytes, and whether the gathered weights are the folder's."""
    from safetensors.torch import load_file

    import lightning_hybrid.parallelize as parallelize_module

    want = load_file(f"{folder}/model.safetensors")
    materialise = parallelize_module.materialise_split_layers
    out = {}
    for name, layout in layouts.items():
        module, peak = CausalLM(folder), _SetupPeak()
        trainer = L.Trainer(accelerator="cpu", devices=4, max_steps=1, limit_val_batches=0, num_sanity_val_steps=0,
                            strategy=HybridStrategy(
                                **layout, **({'micro_batches': 2} if layout.get('pp', 1) > 1 else {})),
                            callbacks=[peak], **QUIET_TRAINER)
        parallelize_module.materialise_split_layers = peak.load(materialise)  # measured, in this process only
        try:
            trainer.fit(module, ByteCorpusDataModule(max_bytes=5_000, block_size=16, batch_size=2))
        finally:
            parallelize_module.materialise_split_layers = materialise
        out[name] = {
            "setup_peak": peak.peak, "before_load_peak": peak.before_load_peak, "load_peak": peak.load_peak,
            # A ZeRO-3 DTensor's shape is its TP-local one (the load happened before ZeRO-3 sharded it over DP).
            "tp_local_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
            "weights_equal": sorted(k for k, v in want.items() if not torch.equal(peak.full[k], v)) or True,
        }
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_pretrained_load_under_tp_reads_only_the_ranks_slices(tmp_path, family):
    """Under tp2 (with dp2 and ZeRO-3) and tp2 x pp2, the weights a rank loads from the folder are the folder's,
    and while it loads them it holds its TP slices plus the one tensor being read, never a layer unsplit.
    (safetensors hands a slice as a view of the memory-mapped tensor, of which only the slice's pages are read;
    the tracker counts the whole mapped tensor, so the bound is one tensor.)"""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    config.num_hidden_layers = 4
    AutoModelForCausalLM.from_config(config).float().save_pretrained(tmp_path)
    layouts = {"dp2xtp2-zero3": dict(dp=2, tp=2, zero_stage=3), "tp2xpp2": dict(tp=2, pp=2)}
    results = run_distributed(_load_under, 4, str(tmp_path), layouts)
    whole = _built(str(tmp_path))
    whole_bytes = storage_bytes(whole.parameters())
    largest_tensor = max(p.numel() * 4 for p in whole.parameters())
    one_layer = storage_bytes(getattr(whole._structure.trunk, whole._structure.layers_name)[0].parameters())
    for rank, per_layout in enumerate(results):
        for name, got in per_layout.items():
            assert got["weights_equal"] is True, (name, rank, got["weights_equal"])
            assert got["tp_local_bytes"] < (0.6 if name.startswith("dp") else 0.35) * whole_bytes, (name, rank, got)
            assert got["load_peak"] <= got["tp_local_bytes"] + largest_tensor, (name, rank, got, largest_tensor)
            assert largest_tensor < one_layer < whole_bytes / 4  # so that the bound above means something


def test_a_folder_that_does_not_fit_the_model_is_refused_when_built(tmp_path):
    """Names and shapes are checked against the model at configure_model, on every rank alike, before the
    strategy's first collective (a rank that failed alone while loading its slices would leave the others waiting)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_config("llama")).float().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(KeyError, match="holds no tensor 'model.norm.weight'"):
        _built(str(tmp_path))
    save_file({**tensors, "model.norm.weight": torch.ones(31)}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.norm.weight: the folder's tensor is \(31,\), the model's \(32,\)"):
        _built(str(tmp_path))


# ---------------------------------------------------------------------------------------------- the config
_SHAPES = dict(hidden_size=64, num_attention_heads=8, num_hidden_layers=2, intermediate_size=128, vocab_size=256)


def _shapes(model) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _transformers_own(model_type: str, **arguments):
    config = T.AutoConfig.for_model(model_type, **arguments)  # the config class's own constructor
    with torch.device("meta"):
        return T.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type, overrides", [
    ("llama", dict(_SHAPES, num_key_value_heads=2)),  # head_dim follows hidden_size / heads (8, not llama's 128)
    ("qwen2", dict(_SHAPES, num_key_value_heads=4)),
    ("mistral", _SHAPES),
    ("qwen3", dict(_SHAPES, head_dim=16)),
    ("gemma", dict(_SHAPES, num_key_value_heads=1)),
    ("phi3", dict(_SHAPES, pad_token_id=0)),
    ("gpt_neox", dict(_SHAPES, rotary_pct=0.5)),
    ("gpt2", dict(n_embd=64, n_head=8, n_layer=2, vocab_size=256)),
])
def test_the_model_is_what_transformers_builds_from_the_same_arguments(model_type, overrides):
    module = CausalLM(model_type, config=overrides)
    module.configure_model()
    assert _shapes(module.model) == _shapes(_transformers_own(model_type, **overrides))


def test_overrides_of_a_config_object_and_of_a_folder_are_given_to_transformers(tmp_path):
    base = T.LlamaConfig(**_SHAPES)  # head_dim 8
    module = CausalLM(base, config={"num_hidden_layers": 1})
    assert module.hf_config.num_hidden_layers == 1 and module.hf_config.head_dim == 8
    base.save_pretrained(tmp_path)
    folder = CausalLM(str(tmp_path), config={"num_hidden_layers": 1, "rms_norm_eps": 1e-5})
    assert (folder.hf_config.num_hidden_layers, folder.hf_config.rms_norm_eps,
            folder.hf_config.head_dim) == (1, 1e-5, 8)


def test_an_override_the_config_does_not_know_is_refused():
    with pytest.raises(ValueError, match=r"\['hiden_size'\].*did you mean \['hidden_size'"):
        CausalLM("llama", config={"hiden_size": 64})


def test_buffers_the_model_holds_itself_are_materialised_with_their_values():
    """GPT-BigCode keeps its causal mask on its trunk (not in a layer): built on the meta device, it is given the
    value the model's own init computes, on every rank (it once stayed on meta: "Cannot copy out of meta tensor")."""
    module = CausalLM("gpt_bigcode", config=dict(n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=16))
    module.configure_model()
    assert not any(t.is_meta for t in [*module.model.parameters(), *module.model.buffers()])
    torch.testing.assert_close(module.model.transformer.bias,
                               torch.tril(torch.ones(16, 16, dtype=torch.bool, device="cpu")))


def test_a_refused_decomposition_leaves_the_models_own_forward_untouched():
    """OPT's position embedding is not what the pipeline's hooks expect, and its layers are refused; the hooks put on
    for the check must go with the refusal, or the model's own forward (pp=1: trained whole) breaks."""
    import copy

    module = CausalLM("opt", config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                                         word_embed_proj_dim=32, vocab_size=256, max_position_embeddings=64,
                                         tie_word_embeddings=False))
    module.configure_model()
    reference = copy.deepcopy(module.model)
    layers = module._structure.layers()
    with pytest.raises(PipelineDecompositionError):
        module.pipeline_layers()
    assert not any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
    module.eval(), reference.eval()  # no dropout
    torch.testing.assert_close(module(ids), reference(input_ids=ids, use_cache=False).logits, rtol=0, atol=0)
