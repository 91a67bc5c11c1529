"""ZeRO over the data-parallel dimension, on persistent gradient buckets.

* stages 0-2 (`ZeroOptimizer` + `GradientBuckets`): the trainable parameters of each optimizer param group are
  laid out in size-capped **buckets** (one dtype, device and TP category each, in backward order), and the
  parameters' ``.grad`` are views into their bucket's flat gradient buffer (as DDP's ``gradient_as_bucket_view``
  and Megatron's ``main_grad``). A post-accumulate-grad hook per parameter notes its gradient; when every
  parameter of a bucket has one in the last backward of an accumulation window, the bucket's reduction starts
  **asynchronously**, overlapping the rest of the backward, and is waited for before clipping and the step:
  - stage 0: all-reduce of each bucket (DDP semantics, 1 x gradients of communication);
  - stage 1: the user's optimizer is re-pointed at this rank's 1/dp slice of each bucket (its state is 1/dp);
    each bucket is reduce-scattered into that slice, the full buffers stay (gradients: Psi);
  - stage 2: as stage 1, but a bucket's full buffer exists only from its first gradient to its reduce-scatter
    (gradients: Psi/dp plus the bucket backward is filling and at most ``MAX_IN_FLIGHT`` being reduced; a
    bucket is freed as soon as its reduce-scatter is done).
  Stages 1 and 2 then all-gather the updated slices into the flat parameter buffers the model's parameters are views
  of (the same communication as DDP's all-reduce in total), bucket by bucket under the next forward where the
  strategy defers them (`ParameterGathers`: a read of a parameter in flight waits for its bucket). On gloo, whose
  reduce-scatter and all-gather copy the whole buffer inside the call, both run as in-place collectives instead
  (`_COPYING_COLLECTIVES`).
* stage 3 (`apply_fsdp`): FSDP2 (`fully_shard`) over the DP sub-mesh (or HSDP's 2-D mesh); parameters, gradients
  and optimizer state are all 1/dp, parameters are gathered per layer for forward and backward (expert-parallel
  experts over their own DP group first: `apply_fsdp_experts`). On gloo FSDP2's all-gather and reduce-scatter are
  replaced by the same in-place collectives, and it prefetches nothing (`_fsdp_on_gloo`).

Gradients are reduced once per optimizer step: nothing is reduced during the earlier backward passes of an
accumulation window (``sync = False``); inside a pipeline schedule each stage's last backward of the window starts
the buckets it completes (`GradientBuckets.eager`), `GradientBuckets.reduce` the rest after it. ZeRO-3 shards over
the `fsdp` mesh: the DP group, or HSDP's 2-D ``(dp_replicate, dp_shard_cp)`` mesh.
Element-wise optimizers (SGD, Adam, AdamW, ...) give exactly the one-device update on the flat slices; an
optimizer that looks across a whole tensor (LAMB, Adafactor, Muon, LBFGS) does not, and stages 1-2 refuse it
(`check_elementwise`; a custom optimizer declares itself with a class attribute ``elementwise_update = True``).
A parameter without a gradient on any DP rank is skipped by one device's optimizer; a slice cannot skip part of
itself, so stages 1-2 refuse such a step with an error naming the parameters (stage 0 skips it as one device does).

Modules: `sharded_gradient` (`ShardedGradient`: the placeholder ``p.grad`` that refuses use where no rank holds the
gradient), `buckets` (the bucket layout, `_Bucket`, `GradientBuckets`, the constants such as
``DEFAULT_BUCKET_CAP_MB``, ``MAX_IN_FLIGHT`` and `_COPYING_COLLECTIVES`), `gather` (`ParameterGathers`: the
updated slices' all-gathers in flight until the next forward reads them), `optimizer` (`ZeroOptimizer`,
`SlicePlace`, `check_elementwise`) and `fsdp` (stage 3: `apply_fsdp`, `apply_fsdp_units`, `apply_fsdp_experts`,
the in-place collectives on gloo); each imports only from those before it, and this package re-exports their
names.
"""

from lightning_hybrid.parallel.zero.buckets import (
    DEFAULT_BUCKET_CAP_MB,
    MAX_IN_FLIGHT,
    GradientBuckets,
)
from lightning_hybrid.parallel.zero.fsdp import (
    AUTO_WINDOW_FRACTION,
    GRAD_REDUCE,
    apply_fsdp,
    apply_fsdp_experts,
    apply_fsdp_units,
)
from lightning_hybrid.parallel.zero.fsdp import _InPlaceAllGather as _InPlaceAllGather  # tests/zero use both
from lightning_hybrid.parallel.zero.fsdp import _InPlaceReduceScatter as _InPlaceReduceScatter
from lightning_hybrid.parallel.zero.gather import ParameterGathers
from lightning_hybrid.parallel.zero.optimizer import (
    ELEMENTWISE_OPTIMIZERS,
    SlicePlace,
    ZeroOptimizer,
    check_elementwise,
)
from lightning_hybrid.parallel.zero.sharded_gradient import ShardedGradient

__all__ = [
    "AUTO_WINDOW_FRACTION",
    "DEFAULT_BUCKET_CAP_MB",
    "GRAD_REDUCE",
    "ELEMENTWISE_OPTIMIZERS",
    "MAX_IN_FLIGHT",
    "GradientBuckets",
    "ParameterGathers",
    "ShardedGradient",
    "SlicePlace",
    "ZeroOptimizer",
    "apply_fsdp",
    "apply_fsdp_experts",
    "apply_fsdp_units",
    "check_elementwise",
]
