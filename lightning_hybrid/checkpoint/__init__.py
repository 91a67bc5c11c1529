"""Sharded, reshardable, crash-safe checkpoints (torch.distributed.checkpoint).

A checkpoint is a folder:
  * DCP shards (one file per rank) holding every tensor in *unsplit* coordinates: ``model/<name>`` for the
    model's parameters and buffers, ``optim/<i>/<name>/<state>`` for optimizer state (Adam's moments ...)
    keyed by parameter name. Each tensor is written once, by one rank of those that hold it (chosen by a
    hash of its name), so the writing is spread over the ranks and nothing is written twice.
  * ``meta.pt`` (rank 0): Lightning's checkpoint dict without weights (loops, LR schedulers, callbacks,
    data module state, hyper-parameters), the optimizers' param-group settings, the saving layout, and the
    size and CRC-32 of every other file (the ranks share the work of computing them). A load checks them first
    (`verify_files`): a truncated, corrupted or missing file is a `CheckpointError` naming it, raised before any
    rank starts reading (by rank 0 alone; the other ranks exit quietly), not a hang or a torch error.

Because the tensors are unsplit, any layout (other dp, tp, pp, ZeRO stage) loads any checkpoint of the same
model: each rank reads only the tensors of its own layers and takes its slices. A save first writes into a
hidden ``.<name>.partial-<token>`` folder and renames it into place once every rank has finished, so a
save killed part way never looks like a checkpoint and the previous one stays as it was.

``python -m lightning_hybrid.checkpoint consolidate CKPT OUT`` writes one plain ``state_dict`` file that the
unparallelised LightningModule loads with ``load_state_dict`` on one process; `lightning_checkpoint` makes a
folder readable by ``LightningModule.load_from_checkpoint``.

Modules: `folders` (the folder's files, `commit`, `read_meta`, `verify_files`, `CheckpointError`, `remove`),
`tensors` (the shared order of the unsplit tensors and their parts), `save` (`save_sharded`, `full_state_dict`),
`load` (`load_sharded`), `consolidate` (`consolidate`, `consolidated_state_dict`, `model_parts`,
`lightning_checkpoint`) and ``__main__`` (the command line); each imports only from those before it, and this
package re-exports their names.
"""

from lightning_hybrid.checkpoint.consolidate import (
    consolidate,
    consolidated_state_dict,
    lightning_checkpoint,
    model_parts,
)
from lightning_hybrid.checkpoint.folders import (
    META_FILE,
    PARTIAL_MARK,
    CheckpointError,
    commit,
    read_meta,
    remove,
    verify_files,
)
from lightning_hybrid.checkpoint.load import check_model_fits, load_sharded
from lightning_hybrid.checkpoint.save import full_state_dict, save_sharded
from lightning_hybrid.checkpoint.tensors import owner_of

__all__ = [
    "META_FILE",
    "PARTIAL_MARK",
    "CheckpointError",
    "check_model_fits",
    "commit",
    "consolidate",
    "consolidated_state_dict",
    "full_state_dict",
    "lightning_checkpoint",
    "load_sharded",
    "model_parts",
    "owner_of",
    "read_meta",
    "remove",
    "save_sharded",
    "verify_files",
]
