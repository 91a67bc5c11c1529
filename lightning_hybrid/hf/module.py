"""`CausalLM`: next-token training of a ``transformers`` causal LM under any layout (see `lightning_hybrid.hf`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_hybrid.core.batch import TokenBatch
from lightning_hybrid.core.devices import module_device
from lightning_hybrid.core.dims import layout_size
from lightning_hybrid.hf.config import _resolve_config
from lightning_hybrid.hf.decomposition import _PipelineCalls, check_decomposition, check_document_masks
from lightning_hybrid.hf.document_attention import (
    DocumentAttention,
    VerifiedAttention,
    attention_for,
    first_packed_stance,
)
from lightning_hybrid.hf.lora import (
    adapter_modules,
    adapter_tensors,
    base_name,
    check_lora_layout,
    init_adapters,
    inject_lora,
    lora_config,
    lora_hparams,
)
from lightning_hybrid.hf.moe import RouterAuxLoss, gather_rows
from lightning_hybrid.hf.structure import PipelineDecompositionError, _Structure, cpu_twin, tensors_of
from lightning_hybrid.hf.weights import Safetensors, tied_keys
from lightning_hybrid.models.language_model import LanguageModel

__all__ = ["CausalLM"]


class CausalLM(LanguageModel):
    """Next-token training of a ``transformers`` causal LM under any layout.

    Args:
        model: a local pretrained folder (``save_pretrained``'s output: config.json + safetensors), a model
            type of ``transformers`` (``"llama"``) with ``config`` overrides, or a ``PretrainedConfig``.
        config: fields of the config that override the folder's or the model type's defaults (random init
            when ``model`` is not a folder).
        lr, weight_decay, betas, warmup_steps: AdamW (decay on parameters with ``dim >= 2``), linear warmup.
        lr_decay, min_lr_ratio, decay_steps: after the warmup, a constant rate (``"none"``) or a ``"cosine"`` or
            ``"linear"`` decay to ``min_lr_ratio * lr`` at step ``decay_steps`` (0: the run's last step).
        init_seed: seed of the random init (each pipeline layer its own, derived from it).
        attn_implementation: passed to ``transformers`` (``None``: its default for the model, SDPA where supported).
        lora: LoRA adapters through ``peft`` (a ``peft.LoraConfig`` or a mapping of its fields, e.g. ``{"r": 16,
            "target_modules": ["q_proj", "v_proj"]}``): the model trains its adapters alone, the rest frozen
            (`lightning_hybrid.hf.lora`); under every layout (TP splits the adapters with their base layers).
        checkpoint_frozen: with ``lora``, ``False`` leaves the frozen base out of checkpoints (the adapters and
            their optimizer state alone; resuming reads the base from ``model`` again).

    Batches are ``(x, y)`` token tensors ``(B, T)``, ``y`` being ``x`` shifted by one (as the package's data
    modules give them), or dict batches of padded or packed documents (`lightning_hybrid.core.batch`), whose
    ``position_ids`` the model's own code turns into its masks (documents kept apart: verified once,
    `check_document_masks`). ``self(x)`` is the logits ``(B, T, V)``. Steps, loss (in float32), optimizer and checkpoint
    loading are those of `lightning_hybrid.models.language_model.LanguageModel` (accuracy on validation only).
    """

    def __init__(
        self,
        model: Union[str, os.PathLike, Any],
        config: Optional[Mapping[str, Any]] = None,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        lr_decay: str = "none",
        min_lr_ratio: float = 0.1,
        decay_steps: int = 0,
        init_seed: int = 0,
        attn_implementation: Optional[str] = None,
        lora: Optional[Any] = None,
        checkpoint_frozen: bool = True,
    ) -> None:
        from transformers import PretrainedConfig

        if isinstance(model, PretrainedConfig):
            spec = {"model_type": model.model_type, **model.to_dict()}
        else:
            spec = str(model) if isinstance(model, os.PathLike) else model
        hf_config = _resolve_config(spec, dict(config or {}))
        super().__init__(int(hf_config.vocab_size), lr, weight_decay, betas, warmup_steps, test_accuracy=False,
                         lr_decay=lr_decay, min_lr_ratio=min_lr_ratio, decay_steps=decay_steps)
        self.save_hyperparameters({
            "model": spec, "config": dict(config or {}), "lr": lr, "weight_decay": weight_decay,
            "betas": tuple(betas), "warmup_steps": warmup_steps, "lr_decay": lr_decay, "min_lr_ratio": min_lr_ratio,
            "decay_steps": decay_steps, "init_seed": init_seed,
            "attn_implementation": attn_implementation,
        })
        #: peft's LoRA config (`lightning_hybrid.hf.lora.lora_config`), or None.
        self.lora = lora_config(lora)
        if not checkpoint_frozen and self.lora is None:
            raise ValueError("checkpoint_frozen=False leaves a LoRA run's frozen base out of its checkpoints; without"
                             " lora nothing is frozen: leave it True, or give lora={...}.")
        #: Whether checkpoints hold the frozen base too (`checkpoint_excludes`); without it, a checkpoint of
        #: Lightning's own strategies loads with the base missing (``strict_loading``).
        self.checkpoint_frozen = bool(checkpoint_frozen)
        self.strict_loading = self.checkpoint_frozen
        self.save_hyperparameters({"lora": None if self.lora is None else lora_hparams(self.lora),
                                   "checkpoint_frozen": self.checkpoint_frozen})
        self.adapted: list[str] = []  # the modules that got adapters
        self.hf_config = hf_config
        self.folder: Optional[Path] = Path(spec) if isinstance(spec, str) and Path(spec).is_dir() else None
        self._structure: Optional[_Structure] = None
        #: The attention of packed batches (`lightning_hybrid.hf.document_attention`): SDPA's, or another verified.
        self.document_attention: Optional[DocumentAttention | VerifiedAttention] = None
        self._calls: Optional[_PipelineCalls] = None
        self._weights: Optional[Safetensors] = None
        self._n_params = 0
        self._aux: Optional[RouterAuxLoss] = None  # the router's auxiliary loss, where the model adds one
        self._router_logits: Optional[tuple[Tensor, ...]] = None
        self._batch_padding: Optional[Tensor] = None  # under pp > 1: the padding mask of the batch being trained
        self._batch_tokens = 0  # and its tokens
        self._pipeline_aux_value: Optional[Tensor] = None  # under pp > 1: the last step's load-balancing loss
        #: Whether `configure_model` left the pipeline layers unbuilt, on the meta device, for the strategy to build
        #: per rank (`lightning_hybrid.core.protocol.DeferredLayers`).
        self.layers_deferred = False

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Build the model on the meta device. Its layers are materialised here unless the strategy builds them
        per rank, calling `init_pipeline_layer` (or `load_pipeline_layer_slices`) itself: when its init context
        is the meta device (``pp > 1``), or under ``tp > 1`` (the model's device mesh), where each rank
        materialises only its TP slices of its layers -- for a model the pipeline layers reproduce (untied
        embeddings; see `check_decomposition`), the others are materialised whole here. ``layers_deferred`` says
        which (`lightning_hybrid.core.protocol.DeferredLayers`)."""
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        per_layer = torch.get_default_device().type == "meta"  # the strategy's init context under pp > 1
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                self.hf_config, attn_implementation=self.hparams.attn_implementation, dtype=torch.float32
            )
        model.config.use_cache = False
        self._check_context_parallel_attention(model)
        # Packed batches without T x T masks where verified (`attention_for`); CP runs its own attention.
        if self._context_parallel_size() == 1:
            self.document_attention = attention_for(model)
        self._aux = RouterAuxLoss.of(model)
        if self._aux is not None and self._pipeline_size() > 1:
            self._check_pipelined_aux_loss(model)
        self._n_params = sum(p.numel() for p in model.parameters())  # the whole model's (for MFU)
        if self.folder is not None:
            self._weights = Safetensors(self.folder)
            self._weights.check(model)
        if self.lora is not None:  # on the meta model: every layout builds the layers with their adapters
            check_lora_layout(self._tp_size(), self.lora)
            self.adapted = inject_lora(model, self.lora)
        self.model = model
        self._structure = _Structure(model)
        self._calls = _PipelineCalls(self._structure)
        with torch.device("cpu"):
            for name in self._structure.shared:  # rotary embeddings and the like: on every stage
                self._materialise(getattr(self._structure.trunk, name), torch.device("cpu"))
            for owner in self._structure._path_modules():  # buffers held by the model and its trunk themselves
                self._materialise_own_buffers(owner)
            # Split layers are built per rank, each rank filling (reading) only its slices: TP's, and the experts
            # of its expert-parallel rank.
            split = self._tp_size() > 1 or self._expert_parallel_size() > 1
            self.layers_deferred = per_layer or (split and self._layerwise())
            if not self.layers_deferred:
                for index, layer in enumerate(self._structure.layers()):
                    layer.to_empty(device="cpu")
                    self.init_pipeline_layer(index, layer)
                if getattr(model.config, "tie_word_embeddings", False):
                    model.tie_weights()

    def checkpoint_excludes(self) -> frozenset[str]:
        """With ``checkpoint_frozen=False``, the frozen base's parameters: `configure_model` reads them from the
        folder (or draws them from ``init_seed``) again on resume (`lightning_hybrid.core.protocol`)."""
        if self.checkpoint_frozen:
            return frozenset()
        return frozenset(n for n, p in self.named_parameters(remove_duplicate=False) if not p.requires_grad)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for name in self.checkpoint_excludes():  # (Lightning's own strategies; HybridStrategy's skips them itself)
            checkpoint.get("state_dict", {}).pop(name, None)

    def _tp_size(self) -> int:
        mesh = self._device_mesh  # set by HybridStrategy before configure_model
        return mesh["tp"].size() if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) else 1

    def _expert_parallel_size(self) -> int:
        trainer = self._trainer
        return layout_size(getattr(trainer, "strategy", None), "ep")

    def _pipeline_size(self) -> int:
        mesh = self._device_mesh
        return mesh["pp"].size() if mesh is not None and "pp" in (mesh.mesh_dim_names or ()) else 1

    def _layerwise(self) -> bool:
        """Whether the strategy can materialise the model layer by layer: its pipeline layers reproduce it (the
        hooks `pipeline_layers` installs leave the model's own forward as it is)."""
        try:
            self.pipeline_layers()
        except PipelineDecompositionError:
            return False
        return True

    def _split_sequence_calls(self) -> None:
        """Once the strategy has set up sequence parallelism (after its setup-time checks, which run on whole
        sequences), decoder layers the pipeline calls with part of the sequence get the arguments of the whole
        (`_PipelineCalls.sequence_split`)."""
        strategy = self.trainer.strategy
        if self._calls is not None:
            sequence_parallel = getattr(getattr(strategy, "options", None), "sequence_parallel", False)
            self._calls.sequence_split = strategy.parallel_dims.tp if sequence_parallel else 1

    def on_fit_start(self) -> None:
        self._split_sequence_calls()

    def on_validation_start(self) -> None:
        self._split_sequence_calls()

    def on_test_start(self) -> None:
        self._split_sequence_calls()

    def on_predict_start(self) -> None:
        self._split_sequence_calls()

    def _materialise(self, module: nn.Module, device: torch.device) -> None:
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            module.to_empty(device=device)
            with torch.no_grad():
                for m in module.modules():
                    self.model._init_weights(m)

    @torch.no_grad()
    def _materialise_own_buffers(self, module: nn.Module) -> None:
        """The buffers ``module`` holds directly (GPT-BigCode's causal mask on its trunk), on the CPU, with the values
        the model's own init gives them (every stage has them, as the parameter-free shared modules)."""
        meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if meta:
            for name in meta:
                module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
            self.model._init_weights(module)

    def _names(self, index: int, layer: nn.Module) -> dict[str, str]:
        """``{folder name: name in the layer}`` of pipeline layer ``index``'s parameters and buffers."""
        assert self._structure is not None
        prefix = self._structure.layer_names()[index]
        return {f"{prefix}.{k}": k for k, _ in tensors_of(layer)}

    # ------------------------------------------------------------------ pipeline protocol
    def pipeline_layers(self) -> list[nn.Module]:
        """The model's modules in order: embeddings, decoder layers, final norm, head (see the module doc).
        Raises `PipelineDecompositionError` where the model's forward does more than those layers do."""
        if self.model is None or self._structure is None or self._calls is None:
            raise RuntimeError("call configure_model() before pipeline_layers()")
        layers = self._structure.layers()
        if getattr(self.model.config, "tie_word_embeddings", False) and getattr(self.model, "_tied_weights_keys", None):
            raise PipelineDecompositionError(
                f"{type(self.model).__name__} ties its input and output embeddings (tie_word_embeddings=True), which"
                " pipeline stages cannot share: train it with pp=1, or untie them (config tie_word_embeddings=False)."
            )
        first = not self._calls._hooked
        self._calls.install(layers)
        if first:
            try:
                check_decomposition(self.model, self._structure)
            except PipelineDecompositionError:
                self._calls.uninstall()  # refused: the model keeps its own forward, untouched (pp=1 trains it whole)
                raise
        return layers

    def pipeline_layer_context(self, layer: nn.Module, hidden: Tensor, side: Mapping[str, Tensor]):
        """Around a pipeline's call of ``layer`` (`PipelineLayerContext`): `_PipelineCalls.around`."""
        return self._calls.around(layer, hidden, side.get("position_ids"), self.document_attention)

    def init_pipeline_layer(self, index: int, layer: nn.Module, pretrained: bool = True) -> None:
        """Materialised layer ``index``: the folder's tensors for it, or (no folder, or ``pretrained=False``) the
        model's init under its own seed."""
        assert self.model is not None
        if self._weights is not None and pretrained:
            self._load(index, layer)
            return
        # The model's init draws from the global generator of the tensors' device: it runs on a CPU twin of the
        # layer, so that the values are those of a CPU run on every device (a CUDA generator draws others).
        on_cpu = module_device(layer).type == "cpu"
        target = layer if on_cpu else cpu_twin(layer)
        adapters = adapter_modules(target)  # their values are set below (`_init_adapters`)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.hparams.init_seed * 1_000_003 + index)
            for m in target.modules():
                if id(m) not in adapters:
                    self.model._init_weights(m)
            if not on_cpu:
                for (_, t), (_, value) in zip(tensors_of(layer), tensors_of(target)):
                    t.copy_(value)
        self._init_adapters(index, layer)

    def _init_adapters(self, index: int, layer: nn.Module) -> None:
        if self.lora is not None:  # (layer ``index``, split or whole)
            assert self._structure is not None
            seed = int(self.hparams.init_seed) + 1_000_003
            init_adapters(layer, self._structure.layer_names()[index], seed, self.lora)

    def load_pipeline_layer_slices(self, index: int, layer: nn.Module) -> bool:
        """Fill the materialised, TP-split layer ``index`` from the folder, reading only this rank's pieces of
        each split tensor (``safe_open().get_slice``; a fused tensor's parts are several pieces). ``False``
        without a folder (the strategy then initialises an unsplit copy of the layer and keeps its slices)."""
        if self._weights is None:
            return False
        self._load(index, layer)
        return True

    @torch.no_grad()
    def _load(self, index: int, layer: nn.Module) -> None:
        """Layer ``index``'s tensors from the folder: whole, or this rank's pieces of those TP split."""
        assert self.model is not None and self._weights is not None
        from lightning_hybrid.parallel.tensor_parallel.layers import tp_shard_specs

        specs = tp_shard_specs(layer)
        params = dict(layer.named_parameters(remove_duplicate=False))
        adapters = {name for name, *_ in adapter_tensors(layer)}
        missing_buffers = []
        for full, local in self._names(index, layer).items():
            if local in adapters:  # not in the folder: drawn below
                continue
            full = base_name(full) or full  # an adapted layer's frozen weight, under the folder's name
            target = params[local] if local in params else layer.get_buffer(local)
            if full not in self._weights.files:
                if local not in params:  # a buffer the folder does not hold (rotary inv_freq ...)
                    missing_buffers.append(local.rpartition(".")[0])
                    continue
                if full in tied_keys(self.model):  # the input embedding's, tied after loading (pp=1)
                    continue
                raise KeyError(f"{self.folder} holds no tensor {full!r} (pipeline layer {index}).")
            if local not in specs:
                value = self._weights.read(full)
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(
                        f"{full}: the folder's tensor is {tuple(value.shape)}, the model's {tuple(target.shape)}."
                    )
                target.copy_(value)
                continue
            spec, group = specs[local]
            rank, size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
            for at, start, n in spec.chunks(rank, size):  # one piece at a time
                target.narrow(spec.dim, at, n).copy_(self._weights.read(full, spec.dim, start, n))
        for owner in dict.fromkeys(missing_buffers):  # the model's init computes them
            self.model._init_weights(layer.get_submodule(owner))
        self._init_adapters(index, layer)

    def forward(
        self, idx: Tensor, position_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None
    ) -> Tensor:
        """``idx (B, T) -> logits (B, T, V)``; ``position_ids`` ``(B, T)`` and/or ``attention_mask``: of a padded or
        packed batch (`lightning_hybrid.core.batch`: both become positions), checked once to keep documents apart in the
        model's own masks (`check_document_masks`)."""
        if self.model is None:
            raise RuntimeError("call configure_model() before using the model")
        cp = self._context_parallel_size()
        position_ids = self._positions(idx, position_ids, attention_mask)
        # Under context parallelism the attention's mask is the strategy's, made for the whole sequence from the
        # positions (`lightning_hybrid.parallel.context_parallel`): the model's own masks are replaced, not relied on.
        if position_ids is not None and self._calls is not None and not self._calls.documents_checked and cp == 1:
            check_document_masks(self._structure, idx.device)
            self._calls.documents_checked = True
        positions = {} if position_ids is None else {"position_ids": position_ids}
        with first_packed_stance(self.document_attention, position_ids):  # verified eagerly, then compiled whole
            output = self.model(input_ids=idx, use_cache=False, **positions)
        if self._aux is not None and self.training and torch.is_grad_enabled():
            self._router_logits = output.router_logits  # for `auxiliary_loss`, right after this forward
        return output.logits

    def _check_context_parallel_attention(self, model: nn.Module) -> None:
        """``ValueError`` under context parallelism for a model whose attention does not run through
        ``torch.nn.functional.scaled_dot_product_attention`` (transformers' ``sdpa`` implementation), the call the
        strategy splits over the sequence."""
        if self._context_parallel_size() == 1:
            return
        implementation = getattr(model.config, "_attn_implementation", None)
        if implementation == "sdpa":
            return
        remedy = ("set attn_implementation='sdpa'" if getattr(model, "_supports_sdpa", False)
                  else f"{type(model).__name__} has no SDPA attention in transformers: train it with cp=1")
        raise ValueError(
            f"cp={self._context_parallel_size()}: {type(model).__name__} runs its attention as {implementation!r},"
            " but context parallelism splits torch.nn.functional.scaled_dot_product_attention over the sequence"
            f" (transformers' 'sdpa'): {remedy}."
        )

    def auxiliary_loss(self, tokens: TokenBatch) -> Optional[tuple[Tensor, Tensor]]:
        """The router's load-balancing loss of a mixture-of-experts model whose config has
        ``output_router_logits=True``, times its ``router_aux_loss_coef``, as the model's own training adds it,
        over the whole data-parallel batch (`lightning_hybrid.hf.moe.RouterAuxLoss`); ``None`` otherwise."""
        logits, self._router_logits = self._router_logits, None
        pipelined, self._pipeline_aux_value = self._pipeline_aux_value, None
        if pipelined is not None:  # under pp > 1: in the loss of the schedule already (`pipeline_aux_loss`)
            self._check_window_of_equal_batches(tokens)
            self.log("train_aux_loss", pipelined, on_step=True, on_epoch=False)
            return None
        if self._aux is None or logits is None:
            return None
        padding, group, scale = tokens.padding, self._data_parallel_group(), 1.0
        rows, tp = logits[0].size(0), self._tp_size()
        if tp > 1 and rows * tp == tokens.input_ids.numel():
            # Sequence parallelism: the routers of this TP rank saw its part of the sequence (`seq_split`'s), so the
            # batch is spread over the DP and TP ranks -- all of them, pp being 1 -- and each part's gradient comes
            # back from the tp ranks that share its loss: once, not tp times.
            mesh = self._device_mesh
            assert mesh is not None
            if padding is not None:
                padding = padding.chunk(tp, dim=1)[mesh["tp"].get_local_rank()]
            group, scale = torch.distributed.group.WORLD, 1.0 / tp
        value = self._aux(list(logits), padding, group, scale)
        return self._aux.coef * value, value

    # ------------------------------------------------------------------ the load-balancing loss under pp > 1
    def _check_pipelined_aux_loss(self, model: nn.Module) -> None:
        """``ValueError`` where the pipeline cannot reproduce the router's loss: routers the model does not record
        through ``transformers``' output capture (whose hooks name the router class), or sequence parallelism
        (each TP rank's routers then see part of the sequence). The schedule (GPipe) is checked by the strategy."""
        strategy = getattr(self._trainer, "strategy", None)
        if self._tp_size() > 1 and getattr(getattr(strategy, "options", None), "sequence_parallel", False):
            raise ValueError(
                f"{type(model).__name__} has output_router_logits=True: under pp > 1 its load-balancing loss is"
                " computed from the routers' logits of the whole batch, which sequence parallelism splits over the TP"
                " ranks: train with sequence_parallel=False (or pp=1), or set output_router_logits=False."
            )
        if self._router_recorder(model) is None:
            raise ValueError(
                f"{type(model).__name__} has output_router_logits=True, but does not say where its router logits come"
                " from (no 'router_logits' in its _can_record_outputs), so the pipeline cannot collect them for its"
                " load-balancing loss: train with pp=1, or set output_router_logits=False in the config."
            )

    @staticmethod
    def _router_recorder(model: nn.Module) -> Optional[tuple[type, Optional[str], Optional[int]]]:
        """``(class, class-name suffix, output index)`` of the modules whose outputs ``transformers`` records as the
        router logits (its ``_can_record_outputs``), or ``None``."""
        spec = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
        if spec is None:
            return None
        if isinstance(spec, type):
            return spec, None, 0
        return getattr(spec, "target_class", None), getattr(spec, "class_name", None), getattr(spec, "index", 0)

    def pipeline_aux_sources(self, layer: nn.Module) -> list[tuple[nn.Module, Optional[int]]]:
        """The routers inside pipeline ``layer`` (`lightning_hybrid.core.protocol.PipelineAuxLoss`): the modules
        ``transformers`` records the router logits of, with the element of their output it records."""
        if self._aux is None or self.model is None:
            return []
        recorder = self._router_recorder(self.model)
        assert recorder is not None  # checked in configure_model
        cls, suffix, index = recorder
        return [(m, index) for m in layer.modules() if (cls is not None and isinstance(m, cls))
                or (suffix is not None and type(m).__name__.endswith(suffix))]

    def pipeline_aux_loss(self, outputs: list[Tensor]) -> Tensor:
        """The router's load-balancing loss of the whole batch times its coefficient, from every MoE layer's router
        logits over the global batch (rows of the DP ranks in rank order) and the batch's padding, gathered alike."""
        assert self._aux is not None
        padding, device = self._batch_padding, outputs[0].device
        mask = padding.reshape(-1).float().to(device) if padding is not None else None
        group = self._data_parallel_group()
        if group is not None and torch.distributed.get_world_size(group) > 1:  # some ranks may have padding, some not
            with torch.no_grad():
                mask = gather_rows(torch.ones(self._batch_tokens, device=device) if mask is None else mask, group)
        value = self._aux(list(outputs), mask, None)
        self._pipeline_aux_value = value.detach()
        return self._aux.coef * value

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        tokens = TokenBatch.from_batch(batch)
        self._batch_padding, self._batch_tokens = tokens.padding, tokens.input_ids.numel()

    def _data_parallel_group(self) -> Optional[torch.distributed.ProcessGroup]:
        """The ranks that hold other parts of the batch: the mesh's ``dp_cp`` group under ``HybridStrategy``, every
        rank under another distributed strategy (DDP, FSDP), none on one process."""
        mesh = self._device_mesh
        if mesh is not None and "dp_cp" in (mesh.mesh_dim_names or ()):
            return mesh["dp_cp"].get_group()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.group.WORLD
        return None

    def _flops_per_token(self, seq_len: int) -> Optional[int]:
        # 6 N per token for the matmuls of forward and backward, plus attention's 12 L H T (Kaplan et al. 2020;
        # PaLM's appendix B), on the whole model (N: all its parameters, counted in configure_model); 4 N for a
        # frozen base under LoRA (the adapters' own are negligible).
        config = self.hf_config
        layers = int(getattr(config, "num_hidden_layers", 0) or 0)
        hidden = int(getattr(config, "hidden_size", 0) or 0)
        weights = 4 if self.lora is not None else 6  # a frozen weight gets no gradient: no weight-gradient GEMM
        return weights * self._n_params + 12 * layers * hidden * seq_len

