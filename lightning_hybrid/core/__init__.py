"""The floor under the dimensions: what every wing of `lightning_hybrid.parallel` may import, and nothing above it.

* `dims`: `ParallelDims`, every layout size, validated together, and the named mesh views built once from them;
* `protocol`: the model contract (the pipeline layers, layer-wise init, loss items, auxiliary losses);
* `collectives`: the autograd-aware collectives of the split layers and their mode under recomputation;
* `split_logits`: logits split over the vocabulary and the cross-entropy computed from their shards;
* `batch`: token batches (ids, labels, masks, positions, document boundaries);
* `devices`: which device a module or tensor lives on;
* `autocast`: autocast's casts for this codebase's own lower-precision ops;
* `hooks`: `StepHooks`, what a dimension does during a step (registered on ``Parallelized.hooks``).

Nothing here imports a dimension (`lightning_hybrid.parallel`), the composition (`lightning_hybrid.parallelize`) or
the strategy.
"""
