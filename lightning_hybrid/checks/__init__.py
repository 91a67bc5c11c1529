"""Checks of what users write (`lightning_hybrid.checks.user_checks.UserCodeChecks`): batches compared within their
peers, declared loss reductions, the first-step probe of the split model, random ops, gradients touched by hand."""
