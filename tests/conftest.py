"""The suite's layout, and what its folders share.

Tests are in folders by concern, each a package (so that files in two folders may share a name and the spawned
ranks of `lightning_hybrid.testing.run_distributed` import a test module by its dotted name, ``tests.<folder>.<file>``):

* ``tensor_parallel/``: the TP plan, `apply_tp` and its verification, layer-by-layer materialisation, transformers
  families under TP; ``pipeline/``: stages, schedules, the training-step binding; ``zero/``: ZeRO stages' memory
  and collectives; ``context_expert/``: context and expert parallelism (MoE).
* ``strategy/``: the strategy and its parity with one device, checkpoints, callbacks, precision, gradient norms,
  the optimizer, rank-zero warnings, the multirun patch, devices and CUDA, `parallelize` without a Trainer, and
  user code.
* ``hf/``: `CausalLM` on transformers models, the reference GPT, fine-tuning parity, per-expert folders.
* ``planner/``: the layout planner (memory, time, search, MoE, CP, Hugging Face configs).
* ``data/``: byte corpora, token shards, fine-tuning data; ``recipes/``: the Hydra recipes end to end;
  ``docs/``: the README and the documentation site.

What several folders use stays in plain modules at this level, imported by name: `tests.helpers` (quiet Trainer
settings, `Recorder`, `storage_bytes`), `tests.parity` (the one-device comparison), `tests.families` (tiny
transformers configs), `tests.user_code`, `tests.user_model` and `tests.user_modules` (modules as users write
them; `tests.user_model` is also named by ``_target_`` in recipe runs), and `tests/scripts/` (programs run by path).
A folder's own helpers are modules beside its tests (`tests/data/sft_helpers.py`,
`tests/tensor_parallel/tp_models.py`).

No fixture is shared between test files: each of the suite's fixtures belongs to one file, and the module-scoped
ones that start process groups (``tp_results`` in `tests/tensor_parallel/test_tensor_parallel_apply.py`,
``two_ranks`` in `tests/strategy/test_user_code.py`) are read only by the tests of their own file, so that each
distributed job runs once. A fixture that tests in more than one file need belongs here (or in its folder's
``conftest.py``), with a session or package scope where it starts ranks.
"""

from lightning_hybrid.testing import preload

# Every rank imports the module of the function it runs, and with it these helpers: imported once, in the fork
# server (`lightning_hybrid.testing.preload`), instead of once a rank.
preload("tests.helpers", "tests.parity", "tests.families", "tests.user_code", "tests.user_model", "tests.user_modules")
