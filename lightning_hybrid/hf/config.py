"""The ``transformers`` config of a `CausalLM`: from a local folder, a model type or a config's dict, with
overrides given to the config's own constructor (`_resolve_config`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__: list[str] = []


def _resolve_config(spec: Any, overrides: dict[str, Any]):
    """The config transformers makes from ``spec`` (a folder, a model type, or a config's dict with its
    ``model_type``) with ``overrides`` given to its own constructor, so that the fields it derives from others
    follow them (llama's ``head_dim`` from ``hidden_size`` and the head count). An override the config class does
    not know is an error naming it (a typo would otherwise be stored and ignored)."""
    import difflib

    from transformers import AutoConfig

    if isinstance(spec, Mapping):
        spec = dict(spec)
        model_type = spec.pop("model_type")
        make = lambda **kw: AutoConfig.for_model(model_type, **{**spec, **kw})  # noqa: E731
    elif isinstance(spec, str) and Path(spec).is_dir():
        folder = spec
        make = lambda **kw: AutoConfig.from_pretrained(folder, **kw)  # noqa: E731
    elif isinstance(spec, str):
        model_type = spec
        make = lambda **kw: AutoConfig.for_model(model_type, **kw)  # noqa: E731
    else:
        raise TypeError(
            f"model={spec!r}: give a local pretrained folder, a model type such as 'llama', or a PretrainedConfig."
        )
    try:
        default = make()
    except ValueError as err:
        raise ValueError(
            f"model={spec!r} is neither a local folder (save_pretrained's output) nor a model type of"
            f" transformers (such as 'llama', 'qwen2', 'gpt2')."
        ) from err
    config = make(**overrides) if overrides else default
    # The constructor consumes what it knows (legacy names too: gpt_neox's rotary_pct); what it does not know, it
    # stores as it is, an attribute the default config lacks.
    unknown = [key for key in overrides if key in vars(config) and not hasattr(default, key)]
    if unknown:
        known = sorted(default.to_dict())
        hints = {key: difflib.get_close_matches(key, known, n=3) for key in unknown}
        raise ValueError(
            f"config overrides {unknown} are not fields of {type(default).__name__}"
            + "".join(f"; {key!r}: did you mean {close}?" for key, close in hints.items() if close)
            + f". Its fields: {known}."
        )
    return config
