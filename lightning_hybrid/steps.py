"""`TrainingSteps`: what one training step runs, and the backward it takes, for a parallelised module.

Three kinds of training step, chosen once per module by what `parallelize` made of it:

* a pipeline (``Parallelized.pipeline``): the user's ``training_step`` runs with ``self(x)`` deferred and
  ``self.loss_fn(output, y)`` running the whole schedule, forward and backward
  (`lightning_hybrid.parallel.pipeline.stages.bind_training`), inside `GradientSync.pipeline_step` (the gradients
  of an accumulation window add up and are reduced once); Lightning's ``backward`` then only gives the gradients
  back;
* a token-weighted loss (the module's ``loss_items(target)``, `lightning_hybrid.core.protocol.PipelineModule`):
  ``self.loss_fn`` also counts the items of its target (`bind_loss_items`); the batch's backward is that of its
  loss *sum* and `GradientSync` divides by the items of the whole window on every DP rank: the loss is the global
  batch's token mean, as one device gives it;
* any other: the step as Lightning runs it (a loss of ``loss_reduction="sum"`` summed over the window).

Every kind runs inside the user checks' first-step guards (`lightning_hybrid.checks.user_checks.UserCodeChecks`),
and after each training step and backward the dimensions' hooks (`lightning_hybrid.core.hooks.StepHooks`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

from torch import Tensor, nn

from lightning_hybrid.checks.user_checks import UserCodeChecks
from lightning_hybrid.grad_sync import GradientSync
from lightning_hybrid.parallel.pipeline.stages import bind_evaluation, bind_training, instance_attributes
from lightning_hybrid.parallelize import Parallelized


class TrainingSteps:
    """The steps of ``module`` (a LightningModule) parallelised as ``parallelized``, with its gradient sync and
    its checks, for a window of ``accumulate`` batches."""

    def __init__(self, module: nn.Module, parallelized: Parallelized, sync: GradientSync, checks: UserCodeChecks,
                 accumulate: int) -> None:
        self.module, self.parallelized, self.sync, self.checks = module, parallelized, sync, checks
        self.accumulate = accumulate
        self.loss_items = self._token_weighting()
        summed = checks.reduction == "sum"
        sync.sum_loss = summed and module.automatic_optimization
        sync.manual = not module.automatic_optimization
        pipeline = parallelized.pipeline
        if pipeline is not None:  # the schedule runs the backward: it applies accumulation's 1/k itself
            pipeline.loss_scale = 1.0 / accumulate
            pipeline.loss_items = self.loss_items
            pipeline.loss_sum = summed
        self._batch_items: Optional[Tensor] = None  # the loss items of the step whose backward comes next

    def _token_weighting(self) -> Optional[Callable[[Tensor], Tensor]]:
        """The module's ``loss_items`` where the loss is token-weighted (automatic optimization), else ``None``."""
        items = getattr(self.module, "loss_items", None)
        return items if callable(items) and self.module.automatic_optimization else None

    def evaluation(self) -> Any:
        """What binds the module's ``self(x)`` outside training steps for the run (a context manager): the
        pipeline's forward-only path, or nothing."""
        pipeline = self.parallelized.pipeline
        return bind_evaluation(self.module, pipeline) if pipeline is not None else None

    def training_step(self, run: Callable[[], Any], batch: Any, first_in_window: bool) -> Any:
        """Run the user's training step (``run()``: Lightning's ``training_step`` of the strategy) as its kind says
        (module doc); ``first_in_window``: the batch starts an accumulation window."""
        self._batch_items = None
        checks, pipeline = self.checks, self.parallelized.pipeline
        checks.refuse_undeclared_loss(batch)
        verify = checks.loss_verifier(self.loss_items, pipelined=pipeline is not None)
        if pipeline is None:
            if self.loss_items is None and verify is None:
                with checks.first_step():
                    output = run()
            else:
                with checks.first_step(), bind_loss_items(self.module, self.loss_items, verify) as counted:
                    output = run()
                if self.loss_items is not None:
                    self._batch_items = counted.items(output)
        else:
            pipeline.verify_loss = verify

            def step() -> Any:
                with bind_training(self.module, pipeline) as binding:
                    output = run()
                binding.check_output(output)
                return output

            with checks.first_step():
                output = self.sync.pipeline_step(step, first_in_window)
            if pipeline.loss_items is not None and output is not None:
                self.sync.add_loss_items(pipeline.last_items)
        for hook in self.parallelized.hooks:
            hook.after_training_step()
        self.sync.parameters_whole()  # ZeRO 1-2: what the forward did not read of the last step's gathers
        return output

    def backward(self, closure_loss: Tensor, run_backward: Callable[[Tensor], Any]) -> Tensor:
        """Lightning's backward of ``closure_loss`` (``run_backward(loss)``: the strategy's), scaled as the step's
        kind needs; its precision plugin's ``post_backward`` then runs the reduction and Lightning's
        ``on_after_backward`` (`settled`). Under PP the schedule ran the backward inside ``training_step``: the
        plugin's ``pre_backward`` (``on_before_backward``, with the window's gradients still kept away), the stashed
        gradients given back, then its ``post_backward``."""
        if self.parallelized.pipeline is not None:
            plugin = self.module.trainer.strategy.precision_plugin
            plugin.pre_backward(closure_loss, self.module)
            self.sync.unstash()
            return plugin.post_backward(closure_loss, self.module)
        items, self._batch_items = self._batch_items, None
        k = self.accumulate
        if items is not None:  # the gradient of the batch's loss sum (Lightning divided the mean by k)
            self.sync.add_loss_items(items)
            run_backward(closure_loss * (items.to(closure_loss) * k))
            return closure_loss
        if self.sync.sum_loss and k > 1:  # a sum over the window: Lightning's division by k undone
            run_backward(closure_loss * k)
            return closure_loss
        return run_backward(closure_loss)

    @contextmanager
    def settled(self) -> Iterator[None]:
        """Lightning's ``on_after_backward`` runs in this context, entered after each backward: the dimensions'
        hooks and the window's reduction first (`after_backward`), so that the hook sees the gradients as they will
        be stepped -- or placeholders that refuse use where no rank holds them (`GradientSync.placeholders`)."""
        self.after_backward()
        with self.sync.placeholders():
            yield

    def after_backward(self) -> None:
        """The dimensions' hooks, then the gradient reduction (nothing inside an accumulation window)."""
        for hook in self.parallelized.hooks:
            hook.after_backward()
        self.sync.reduce()


class LossItems:
    """What `bind_loss_items` counted: the items of the target of each ``loss_fn`` call of one training step."""

    def __init__(self) -> None:
        self.counts: list[Tensor] = []
        self.calls = 0

    def items(self, output: object) -> Optional[Tensor]:
        """The step's loss items; ``None`` for a skipped step (``None`` output). ``TypeError`` unless the step
        called ``loss_fn`` exactly once (the loss it returns is then the mean over those items)."""
        if output is None:
            return None
        if len(self.counts) != 1:
            raise TypeError(
                f"The module defines loss_items, so its loss is weighted by the tokens of each batch: training_step"
                f" must compute its loss with one call of self.loss_fn(output, target) (it made {len(self.counts)})."
                " Remove loss_items to train with the mean of per-batch means instead."
            )
        return self.counts[0].detach()


@contextmanager
def bind_loss_items(module: nn.Module, loss_items: Optional[Callable[[Tensor], Tensor]],
                    verify: Optional[Callable[..., Optional[str]]] = None) -> Iterator[LossItems]:
    """During a training step (no pipeline), ``self.loss_fn(output, target)`` also counts ``loss_items(target)``
    (where given) and, at its first call, ``verify(loss_fn, output, target)`` (where given) says what is wrong with
    the loss (`lightning_hybrid.checks.loss_semantics.check_decomposition`): a ``ValueError``."""
    counted = LossItems()
    loss_fn = module.loss_fn

    def counting(output: Any, target: Tensor, *args: Any, **kwargs: Any) -> Any:
        if verify is not None and counted.calls == 0 and not args and not kwargs:
            message = verify(loss_fn, output, target)
            if message is not None:
                raise ValueError(message)
        counted.calls += 1
        if loss_items is not None:
            counted.counts.append(loss_items(target))
        return loss_fn(output, target, *args, **kwargs)

    with instance_attributes(module, loss_fn=counting):
        yield counted
