"""LightningModule wrapping the reference :class:`~lightning_hybrid.models.gpt.GPT`.

The inner model is created lazily in :meth:`GPTLightningModule.configure_model`
(so that a strategy can build / shard it on the right device) under a private,
fixed RNG seed: the initial weights are identical in every process and under
every strategy.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any, Dict, Optional, Tuple, Union

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics

from lightning_hybrid.checkpoint import lightning_checkpoint
from lightning_hybrid.models.gpt import GPT, GPTConfig
from lightning_hybrid.optim import adamw

__all__ = ["GPTLightningModule"]

Batch = Tuple[torch.Tensor, torch.Tensor]


class GPTLightningModule(L.LightningModule):
    """Next-token language modelling with a :class:`GPT`.

    Args:
        config: model config (a :class:`GPTConfig` or a dict of its fields, as
            stored in ``hparams``); ``None`` means ``GPTConfig()``.
        lr: peak AdamW learning rate.
        weight_decay: decoupled weight decay, applied only to parameters with ``dim >= 2``.
        betas: AdamW betas.
        warmup_steps: if > 0, linear warmup of the learning rate over that many
            optimizer steps (``LambdaLR`` with interval ``"step"``).
        init_seed: seed used to initialise the inner model's weights.
        **config_overrides: fields of :class:`GPTConfig` overriding ``config``
            (e.g. ``n_layer=4``).

    Batches are ``(x, y)`` pairs of ``LongTensor (B, T)``; ``y`` is ``x`` shifted by one.

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
        init_seed: int = 0,
        **config_overrides: Any,
    ) -> None:
        super().__init__()
        if config is None:
            base: Dict[str, Any] = {}
        elif isinstance(config, GPTConfig):
            base = dict(vars(config))
        else:
            base = dict(config)
        base.update(config_overrides)
        self.config = GPTConfig(**base)
        # Store the resolved config as a plain dict so checkpoints/hparams stay simple.
        self.save_hyperparameters(
            {
                "config": dict(vars(self.config)),
                "lr": lr,
                "weight_decay": weight_decay,
                "betas": tuple(betas),
                "warmup_steps": warmup_steps,
                "init_seed": init_seed,
            }
        )
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.warmup_steps = warmup_steps
        self.init_seed = init_seed
        self.model: Optional[GPT] = None
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(
            num_classes=self.config.vocab_size, average="micro"
        )
        self.test_acc = torchmetrics.classification.MulticlassAccuracy(
            num_classes=self.config.vocab_size, average="micro"
        )

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Build the inner :class:`GPT` (once) with weights seeded by ``init_seed`` (a private generator: the
        global RNG state is left untouched)."""
        if self.model is not None:
            return
        with torch.random.fork_rng(devices=[]):  # nn.Linear's own default init draws from the global RNG
            self.model = GPT(self.config, init_seed=self.init_seed)

    # ------------------------------------------------------------------ pipeline protocol
    def pipeline_layers(self) -> list[torch.nn.Module]:
        """The model in order (``embed, *blocks, head``): ``forward(x)`` applies them in sequence."""
        return self.model.layers()

    def init_pipeline_layer(self, index: int, layer: torch.nn.Module) -> None:
        """Initialise pipeline layer ``index`` (materialised from the meta device) as a one-device init would."""
        self.model.init_layer(index, layer)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx: LongTensor (B, T) -> logits (B, T, V)``."""
        if self.model is None:
            raise RuntimeError("call configure_model() before using the model")
        return self.model(idx)

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy; ``logits (B, T, V)``, ``targets (B, T)`` -> scalar."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Union[str, Path, IO], *args: Any, **kwargs: Any) -> "GPTLightningModule":
        """Lightning's ``load_from_checkpoint``; a sharded checkpoint folder is consolidated in memory first."""
        return super().load_from_checkpoint(lightning_checkpoint(checkpoint_path), *args, **kwargs)

    # ------------------------------------------------------------------ steps
    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        # Read by Lightning's ThroughputMonitor, which reports model FLOPs utilisation from it: the training
        # FLOPs of this batch on the whole model (a subclass may build another model, without the count).
        if isinstance(self.model, GPT):
            x, _ = batch
            self.flops_per_batch = self.model.flops_per_token(x.size(1)) * x.numel()

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def _eval_step(self, batch: Batch, prefix: str, metric: torchmetrics.Metric) -> torch.Tensor:
        x, y = batch
        logits = self(x)  # (B, T, V)
        loss = self.loss_fn(logits, y)
        metric.update(logits.argmax(-1).flatten(), y.flatten())
        self.log(f"{prefix}_loss", loss, prog_bar=True, sync_dist=True, on_epoch=True)
        self.log(f"{prefix}_acc", metric, on_epoch=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "val", self.val_acc)

    def test_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "test", self.test_acc)

    # -------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> Any:
        """AdamW with weight decay on matrices/embeddings (``dim >= 2``) only, fused on CUDA
        (`lightning_hybrid.optim.adamw`)."""
        if self.model is None:
            raise RuntimeError("call configure_model() before configure_optimizers()")
        optimizer = adamw(self.model, self.lr, self.weight_decay, self.betas)
        if self.warmup_steps <= 0:
            return optimizer
        warmup = self.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }
