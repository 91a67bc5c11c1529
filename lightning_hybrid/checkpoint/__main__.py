"""Sharded, reshardable, crash-safe checkpoints (torch.distributed.checkpoint).

The command line (this first line is its description)::

    python -m lightning_hybrid.checkpoint consolidate CKPT OUT

writes one plain ``state_dict`` file that the unparallelised LightningModule loads (`consolidate`); exit code 2
for a path that is not a whole checkpoint.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable

from lightning_hybrid.checkpoint.consolidate import consolidate
from lightning_hybrid.checkpoint.folders import CheckpointError


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_hybrid.checkpoint", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cons = sub.add_parser("consolidate", help="write one plain state_dict file that the unparallelised model loads")
    cons.add_argument("checkpoint")
    cons.add_argument("out")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        state = consolidate(args.checkpoint, args.out)
    except CheckpointError as err:
        print(f"error: {err}", file=os.sys.stderr)
        return 2
    print(f"wrote {len(state)} tensors to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
