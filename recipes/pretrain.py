"""Pretrain the reference GPT with `HybridStrategy`, configured by Hydra (`configs/pretrain.yaml`).

    python recipes/pretrain.py                                          # tiny model, stdlib corpus, 1 CPU
    python recipes/pretrain.py parallel=tp parallel.tp=2 trainer.max_steps=20
    python recipes/pretrain.py model=small data=text 'data.paths=[/my/corpus]' parallel=dp_tp trainer=gpu
    python recipes/pretrain.py -m parallel=dp,tp,zero1 max_steps=50      # layout sweep -> summary.md/csv/png

Layouts (configs/parallel/): single, dp, tp, dp_tp, zero1, zero2, zero3; devices = dp*tp*pp unless
`trainer.devices` is set. Each run writes metrics.json (final val loss, tokens/s, peak memory per rank),
CSV logs and checkpoints into its Hydra output dir; a multirun also writes summary.* into the sweep dir.
A bad config prints one `error: ...` line to stderr and exits with code 2.
"""

import os
import sys

os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # let config errors reach the handler below, not Hydra's report

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from lightning_hybrid.config import run_pretrain  # noqa: E402  (registers the config schema)


def _error_exit(err: BaseException) -> None:
    print(f"error: {_one_line(err)}", file=sys.stderr, flush=True)
    sys.exit(2)  # SystemExit passes through Hydra's job runner (which reports only `Exception`s)


@hydra.main(config_path="../configs", config_name="pretrain", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run_pretrain(cfg)
    except (ValueError, FileNotFoundError) as err:  # bad layout, missing data path, ...
        _error_exit(err)


def _one_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    cause = err.__cause__
    if cause is not None:
        lines += [ln.strip() for ln in str(cause).splitlines()[:1] if ln.strip()]
    return " ".join(lines[:20]) or type(err).__name__


if __name__ == "__main__":
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        main()
    except (ValueError, FileNotFoundError, HydraException, OmegaConfBaseException) as err:  # composition errors
        _error_exit(err)
