"""LightningModule wrapping the reference :class:`~lightning_hybrid.models.gpt.GPT`.

The inner model is created lazily in :meth:`GPTLightningModule.configure_model`
(so that a strategy can build / shard it on the right device) under a private,
fixed RNG seed: the initial weights are identical in every process and under
every strategy. Steps, loss, optimizer and checkpoint loading are those of
:class:`~lightning_hybrid.models.language_model.LanguageModel`.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch

from lightning_hybrid.models.gpt import GPT, GPTConfig
from lightning_hybrid.models.language_model import LanguageModel

__all__ = ["GPTLightningModule"]


class GPTLightningModule(LanguageModel):
    """Next-token language modelling with a :class:`GPT`.

    Args:
        config: model config (a :class:`GPTConfig` or a dict of its fields, as
            stored in ``hparams``); ``None`` means ``GPTConfig()``.
        lr: peak AdamW learning rate.
        weight_decay: decoupled weight decay, applied only to parameters with ``dim >= 2``.
        betas: AdamW betas.
        warmup_steps: if > 0, linear warmup of the learning rate over that many
            optimizer steps (``LambdaLR`` with interval ``"step"``).
        lr_decay, min_lr_ratio, decay_steps: after the warmup, a constant rate (``"none"``) or a ``"cosine"`` or
            ``"linear"`` decay to ``min_lr_ratio * lr`` at step ``decay_steps`` (0: the run's last step).
        init_seed: seed used to initialise the inner model's weights.
        **config_overrides: fields of :class:`GPTConfig` overriding ``config``
            (e.g. ``n_layer=4``).

    Batches are ``(x, y)`` pairs of ``LongTensor (B, T)`` (``y`` is ``x`` shifted by one), or dict batches of
    padded or packed documents (`lightning_hybrid.core.batch`).

    ``GPTLightningModule.load_from_checkpoint(path)`` also takes the checkpoint folder a ``HybridStrategy`` run
    writes: the consolidated weights are loaded on this one process.
    """

    def __init__(
        self,
        config: Optional[Union[GPTConfig, Dict[str, Any]]] = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: Tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        lr_decay: str = "none",
        min_lr_ratio: float = 0.1,
        decay_steps: int = 0,
        init_seed: int = 0,
        **config_overrides: Any,
    ) -> None:
        if config is None:
            base: Dict[str, Any] = {}
        elif isinstance(config, GPTConfig):
            base = dict(vars(config))
        else:
            base = dict(config)
        base.update(config_overrides)
        resolved = GPTConfig(**base)
        super().__init__(resolved.vocab_size, lr, weight_decay, betas, warmup_steps, test_accuracy=True,
                         lr_decay=lr_decay, min_lr_ratio=min_lr_ratio, decay_steps=decay_steps)
        self.config = resolved
        # Store the resolved config as a plain dict so checkpoints/hparams stay simple.
        self.save_hyperparameters(
            {
                "config": dict(vars(self.config)),
                "lr": lr,
                "weight_decay": weight_decay,
                "betas": tuple(betas),
                "warmup_steps": warmup_steps,
                "lr_decay": lr_decay, "min_lr_ratio": min_lr_ratio, "decay_steps": decay_steps,
                "init_seed": init_seed,
            }
        )
        self.init_seed = init_seed
        self.model: Optional[GPT] = None
        # ``layers_deferred`` (`lightning_hybrid.core.protocol.DeferredLayers`) is set by configure_model, not
        # here: a subclass building another model in its own configure_model keeps the strategy's default (its
        # layers are built per rank where they are still on the meta device).

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Build the inner :class:`GPT` (once) with weights seeded by ``init_seed`` (a private generator: the
        global RNG state is left untouched). Under the strategy's init context of ``pp > 1`` (the meta device) it
        is built on the meta device, its layers left to the strategy (``layers_deferred``), which builds each
        rank's own with `init_pipeline_layer`."""
        if self.model is not None:
            return
        self.layers_deferred = torch.get_default_device().type == "meta"
        with torch.random.fork_rng(devices=[]):  # nn.Linear's own default init draws from the global RNG
            self.model = GPT(self.config, init_seed=self.init_seed)

    def _flops_per_token(self, seq_len: int) -> Optional[int]:
        # GPT's own count, from its config (a subclass may build another model, without the count).
        return self.model.flops_per_token(seq_len) if isinstance(self.model, GPT) else None

    # ------------------------------------------------------------------ pipeline protocol
    def pipeline_layers(self) -> list[torch.nn.Module]:
        """The model in order (``embed, *blocks, head``): ``forward(x)`` applies them in sequence."""
        return self.model.layers()

    def init_pipeline_layer(self, index: int, layer: torch.nn.Module) -> None:
        """Initialise pipeline layer ``index`` (materialised from the meta device) as a one-device init would."""
        self.model.init_layer(index, layer)

    def forward(self, idx: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``idx: LongTensor (B, T) -> logits (B, T, V)``; ``position_ids`` ``(B, T)`` and/or ``attention_mask``:
        of a padded or packed batch (`lightning_hybrid.core.batch`)."""
        if self.model is None:
            raise RuntimeError("call configure_model() before using the model")
        return self.model(idx, self._positions(idx, position_ids, attention_mask))
