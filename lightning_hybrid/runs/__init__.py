"""Hydra recipe runs: the run itself (`recipe`), its config and instantiation (`config`), resuming (`resume`), the
callbacks a run adds (`callbacks`, `memory`) and the layout-sweep summary (`sweep`)."""
