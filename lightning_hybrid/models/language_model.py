"""`LanguageModel`: the next-token training that the package's LightningModules share -- `GPTLightningModule` (the
reference GPT) and `lightning_hybrid.hf.CausalLM` (any ``transformers`` causal LM).

A subclass builds its model as ``self.model`` in ``configure_model``, maps token ids to logits in ``forward``,
saves its own hyperparameters, and may give its training FLOPs per token (`LanguageModel._flops_per_token`). The
rest is here, the same for both:

* ``training_step`` / ``validation_step`` / ``test_step`` on ``(x, y)`` batches of token ids ``(B, T)``, ``y``
  being ``x`` shifted by one, or on dict batches (``input_ids``, ``labels``, ``attention_mask``, ``position_ids``:
  padded and packed fine-tuning data, `lightning_hybrid.core.batch`), whose positions reach the model as
  ``self(input_ids, position_ids=...)``: logged are ``train_loss`` (per step), ``val_loss`` / ``test_loss`` and
  the accuracies ``val_acc`` (and ``test_acc`` where the subclass measures it) per epoch, every loss the mean over
  the loss-taking tokens of the whole (data-parallel) batch;
* `LanguageModel.loss_fn`: the mean cross entropy over the labels other than -100, computed in float32 whatever
  the logits' dtype (the pipeline protocol's ``loss_fn``: under ``pp > 1`` the strategy calls it on the last
  stage's output), and `LanguageModel.loss_items`, the number of tokens it averages over, with which
  ``HybridStrategy`` makes the loss the mean over every token of the global batch (data-parallel ranks,
  micro-batches, accumulated batches), not a mean of means;
* ``flops_per_batch`` (read by Lightning's ``ThroughputMonitor`` for MFU), set in ``on_train_batch_start``;
* ``configure_optimizers``: AdamW (`lightning_hybrid.optim.adamw`), a linear warmup and a cosine or linear decay
  (`lightning_hybrid.optim.lr_factor`);
* ``load_from_checkpoint``, which also takes the sharded checkpoint folder a ``HybridStrategy`` run writes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import IO, Any, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import Tensor, nn
from typing_extensions import Self

from lightning_hybrid.checkpoint import lightning_checkpoint
from lightning_hybrid.core.batch import TokenBatch, count_loss_items
from lightning_hybrid.core.dims import layout_size
from lightning_hybrid.optim import adamw, check_schedule, lr_factor

__all__ = ["Batch", "LanguageModel"]

#: ``(x, y)`` token tensors, or a dict batch (`lightning_hybrid.core.batch`).
Batch = Union[tuple[Tensor, Tensor], dict[str, Tensor]]


class LanguageModel(L.LightningModule):
    """Next-token training of ``self.model`` (built by the subclass in ``configure_model``).

    Args:
        vocab_size: the number of tokens (the accuracy metrics' classes).
        lr, weight_decay, betas: AdamW's (weight decay on parameters with ``dim >= 2`` only). Kept as attributes
            of the same names, which `configure_optimizers` reads.
        warmup_steps: if > 0, a linear warmup of the learning rate over that many optimizer steps.
        test_accuracy: whether ``test_step`` measures and logs ``test_acc`` too (``val_acc`` always).
        lr_decay: after the warmup, ``"none"`` (constant), ``"cosine"`` or ``"linear"`` decay to
            ``min_lr_ratio * lr`` at step ``decay_steps`` (0: the run's last step, Lightning's
            ``estimated_stepping_batches``), constant after.

    The subclass calls ``save_hyperparameters`` itself (its hyperparameters are its own).
    """

    def __init__(
        self,
        vocab_size: int,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        warmup_steps: int,
        test_accuracy: bool = True,
        lr_decay: str = "none",
        min_lr_ratio: float = 0.1,
        decay_steps: int = 0,
    ) -> None:
        super().__init__()
        check_schedule(warmup_steps, lr_decay, min_lr_ratio, decay_steps)
        self.vocab_size = vocab_size
        self.lr = lr
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.warmup_steps = warmup_steps
        self.lr_decay, self.min_lr_ratio, self.decay_steps = lr_decay, min_lr_ratio, decay_steps
        self.model: Optional[nn.Module] = None
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=vocab_size, average="micro")
        if test_accuracy:
            self.test_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=vocab_size, average="micro")

    # ------------------------------------------------------------------ what a subclass may give
    def _flops_per_token(self, seq_len: int) -> Optional[int]:
        """Training FLOPs (forward and backward) per token of the whole model at sequence length ``seq_len``, also
        where a rank holds only some of its layers; ``None`` (the default): not known, no ``flops_per_batch``."""
        return None

    # ------------------------------------------------------------------ loss and checkpoints
    @staticmethod
    def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross entropy, computed in float32; ``logits (B, T, V)``, ``targets (B, T)`` -> scalar (targets equal
        to cross entropy's default ``ignore_index``, -100, are left out; 0 where all are)."""
        flat = targets.flatten()
        total = F.cross_entropy(logits.float().flatten(0, 1), flat, reduction="sum")
        return total / count_loss_items(flat).clamp_min(1)  # 0, not NaN, where every target is ignored

    @staticmethod
    def loss_items(targets: Tensor) -> Tensor:
        """The number of targets `loss_fn` averages over (those other than -100); ``HybridStrategy`` weighs each
        micro-batch's and rank's loss by it (the token-weighted mean of the global batch)."""
        return count_loss_items(targets)

    def _log_token_mean(
        self, name: str, loss: Tensor, items: Tensor, plus: Optional[Tensor] = None, **kwargs: Any
    ) -> None:
        """Log ``loss`` (the mean over this rank's ``items`` tokens) as the mean over every token of the batch on
        all data-parallel ranks, plus ``plus`` (a term of the whole batch, the same on every rank); per epoch,
        weighted by the tokens of each batch."""
        stats = torch.stack([loss.detach().float() * items, items.float()])
        if self._trainer is not None:
            stats = self.trainer.strategy.reduce(stats, reduce_op="sum")
        total = int(stats[1])
        value = stats[0] / max(total, 1)
        if plus is not None:
            value = value + plus.to(value)
        self.log(name, value, batch_size=max(total, 1), **kwargs)

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Union[str, Path, IO], *args: Any, **kwargs: Any) -> Self:
        """Lightning's ``load_from_checkpoint``; a sharded checkpoint folder is consolidated in memory first (the
        whole model's weights are loaded on this one process)."""
        return super().load_from_checkpoint(lightning_checkpoint(checkpoint_path), *args, **kwargs)

    @staticmethod
    def _positions(
        idx: Tensor, position_ids: Optional[Tensor], attention_mask: Optional[Tensor]
    ) -> Optional[Tensor]:
        """The one side input the models take, from ``self(idx, position_ids=..., attention_mask=...)`` as a
        ``transformers`` user would call it (`lightning_hybrid.core.batch.TokenBatch`)."""
        if attention_mask is None:
            return position_ids
        batch = {"input_ids": idx, "attention_mask": attention_mask, "position_ids": position_ids}
        return TokenBatch.from_batch(batch).position_ids

    # ------------------------------------------------------------------ steps
    def on_train_batch_start(self, batch: Batch, batch_idx: int) -> None:
        # Read by Lightning's ThroughputMonitor, which reports model FLOPs utilisation from it: the training FLOPs
        # of this batch on the whole model.
        x = TokenBatch.from_batch(batch).input_ids
        cp = self._context_parallel_size()  # x holds 1/cp of each sequence: the batch's FLOPs are the whole's
        per_token = self._flops_per_token(x.size(1) * cp)
        if per_token is not None:
            self.flops_per_batch = per_token * x.numel() * cp

    def _context_parallel_size(self) -> int:
        return layout_size(getattr(self._trainer, "strategy", None), "cp")

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        tokens = TokenBatch.from_batch(batch)
        loss = self.loss_fn(self(tokens.input_ids, **tokens.model_inputs()), tokens.labels)
        aux = self.auxiliary_loss(tokens)
        if aux is None:
            self._log_token_mean("train_loss", loss, tokens.loss_items(), prog_bar=True, on_step=True, on_epoch=False)
            return loss
        term, value = aux
        self._check_window_of_equal_batches(tokens)
        self.log("train_aux_loss", value.detach(), on_step=True, on_epoch=False)
        self._log_token_mean("train_loss", loss, tokens.loss_items(), plus=term.detach(), prog_bar=True,
                             on_step=True, on_epoch=False)
        return loss + term

    def _check_window_of_equal_batches(self, tokens: TokenBatch) -> None:
        """An auxiliary loss under gradient accumulation: each batch's is that batch's (the loss of a window as one
        batch is not reachable by a backward per batch), weighed like every batch by its loss tokens -- the
        ``1 / accumulate_grad_batches`` one device accumulating the same batches gives it only where every batch of
        the window has as many loss tokens. So under accumulation a batch whose rows are not all whole (padding, or
        ignored labels beyond a row's last token) is refused, on every rank (one all-reduce of a flag)."""
        trainer = self._trainer
        window = getattr(trainer, "accumulate_grad_batches", 1) if trainer is not None else 1
        if window <= 1:
            return
        counts = (tokens.labels != -100).sum(-1)
        uneven = bool((counts < tokens.labels.size(-1) - 1).any())
        flag = torch.tensor([int(uneven)], device=counts.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if int(flag):
            raise ValueError(
                f"{type(self).__name__} adds an auxiliary loss of the whole batch (a mixture-of-experts router's"
                f" load-balancing loss), and with accumulate_grad_batches={window} its batches have padding or"
                " ignored labels: each batch's auxiliary loss would be weighed by the batch's share of the window's"
                f" loss tokens rather than 1/{window}, and the window's loss as one batch (the router's statistics"
                " over all its tokens) is not reachable by a backward per batch. Train with"
                " accumulate_grad_batches=1 and a larger batch (more data-parallel ranks; under pp > 1 more"
                " micro-batches), batches of whole rows (token pairs), or without the auxiliary loss"
                " (transformers: output_router_logits=False)."
            )

    def auxiliary_loss(self, tokens: TokenBatch) -> Optional[tuple[Tensor, Tensor]]:
        """A term the model's own training adds to the loss of the batch just run forward (``tokens``), as
        ``(term, value)``: ``term`` is added to the token-mean loss this rank returns, ``value`` logged as
        ``train_aux_loss``. It must be the same on every data-parallel rank, the loss of the whole (global) batch:
        the strategy's token weighting then makes its gradient exactly ``term``'s on one device (see
        `lightning_hybrid.hf.moe`). ``None`` (the default): no such term."""
        return None

    def _eval_step(self, batch: Batch, stage: str) -> Tensor:
        """The loss (and accuracy, where the stage has a metric ``{stage}_acc``) of an evaluation batch."""
        tokens = TokenBatch.from_batch(batch)
        y = tokens.labels
        logits = self(tokens.input_ids, **tokens.model_inputs())  # (B, T, V)
        loss = self.loss_fn(logits, y)
        metric = getattr(self, f"{stage}_acc", None)
        if metric is not None:
            kept = y.flatten() != -100
            metric.update(logits.argmax(-1).flatten()[kept], y.flatten()[kept])
        # The same value on every rank: sync_dist (a mean of equal values) only keeps Lightning from warning.
        self._log_token_mean(f"{stage}_loss", loss, tokens.loss_items(), prog_bar=True, on_epoch=True, sync_dist=True)
        if metric is not None:
            self.log(f"{stage}_acc", metric, on_epoch=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return self._eval_step(batch, "val")

    def test_step(self, batch: Batch, batch_idx: int) -> Tensor:
        return self._eval_step(batch, "test")

    # ------------------------------------------------------------------ optimizer
    def configure_optimizers(self) -> Any:
        """AdamW with weight decay on matrices and embeddings (``dim >= 2``) only, fused on CUDA
        (`lightning_hybrid.optim.adamw`); with a warmup or a decay, its schedule (``LambdaLR`` of
        `lightning_hybrid.optim.lr_factor`, interval ``"step"``: saved in checkpoints, resumed with them)."""
        if self.model is None:
            raise RuntimeError("call configure_model() before configure_optimizers()")
        optimizer = adamw(self.model, self.lr, self.weight_decay, tuple(self.betas))
        warmup, decay = int(self.warmup_steps), str(self.lr_decay)
        if warmup <= 0 and decay == "none":
            return optimizer
        total = int(self.decay_steps)  # a decay to the run's last step reads it from the Trainer
        if decay != "none" and total <= 0:
            total = int(self.trainer.estimated_stepping_batches)
        factor = functools.partial(lr_factor, warmup_steps=warmup, lr_decay=decay,
                                   min_lr_ratio=float(self.min_lr_ratio), total_steps=total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
