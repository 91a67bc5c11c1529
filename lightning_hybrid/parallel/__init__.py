"""The wing of dimensions: one module (or package) per parallel dimension, each with its ``apply_*`` step(s).

`lightning_hybrid.parallelize` composes them in their one order; what a dimension must do during a step it
registers as a hook on `lightning_hybrid.parallelize.Parallelized` (`lightning_hybrid.core.hooks.StepHooks`), which
the strategy calls without naming any dimension. A dimension imports only the floor (`lightning_hybrid.core`), the
runtime (`lightning_hybrid.runtime`: errors raised from rank zero) and its own modules, never another dimension
(docs/adding-a-dimension.md).
"""
