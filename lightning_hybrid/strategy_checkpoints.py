"""`ShardedCheckpoints`: Lightning's checkpoint hooks of `lightning_hybrid.strategy.HybridStrategy`.

Checkpoints are sharded, reshardable, crash-safe folders (`lightning_hybrid.checkpoint`), written from and read into
the live model and optimizers, so Lightning's own state-dict hooks have nothing to do: they return nothing and load
nothing, and ``save_checkpoint`` / ``load_checkpoint`` do the work, collectively, on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from torch import Tensor
from torch.optim import Optimizer

from lightning_hybrid.checkpoint import full_state_dict, load_sharded, save_sharded
from lightning_hybrid.checkpoint import remove as remove_checkpoint_path


class ShardedCheckpoints:
    """Mixed into `HybridStrategy` (before `MeshStrategy`): reads its module, optimizers, meshes, options and
    gradient sync; `_gathered` waits for ZeRO 1-2's parameter gathers in flight before a checkpoint reads the
    parameters' storage (the strategy also before validation and at the end of training)."""

    def _gathered(self) -> None:
        """ZeRO 1-2's parameter gathers of the last step all done (`GradientSync.parameters_whole`)."""
        if getattr(self, "_sync", None) is not None:
            self._sync.parameters_whole()

    def full_state_dict(self) -> dict[str, Tensor]:
        """The full (unsplit) state dict on every rank, gathered over every dimension (collective); the plain
        one-device module loads it with ``load_state_dict``."""
        assert self.lightning_module is not None
        self._gathered()
        return full_state_dict(self.lightning_module, self.pp_group)

    restore_checkpoint_after_setup = property(lambda self: True)  # read into the parallelised model and optimizers
    lightning_restore_optimizer = property(lambda self: False)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done in load_checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError("HybridStrategy.save_checkpoint(..., storage_options=...) is not supported.")
        assert self.lightning_module is not None
        self._gathered()  # DCP reads the parameters' storage, not through torch functions
        save_sharded(self.broadcast(str(filepath)), self.lightning_module, self.optimizers, self.meshes, checkpoint,
                     self.options.zero_stage, int(self.options.bucket_cap_mb * 2**20), self.root_device)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        self._gathered()
        return load_sharded(self.broadcast(str(checkpoint_path)), self.lightning_module, self.optimizers)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint_path(filepath)


def refuse_checkpoint_io(io: Any) -> None:
    if io is not None:
        raise ValueError(
            f"checkpoint_io={io!r} would not be used: HybridStrategy writes sharded, reshardable checkpoints itself"
            " (lightning_hybrid.checkpoint, through torch.distributed.checkpoint). Leave it unset."
        )
