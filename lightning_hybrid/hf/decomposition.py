"""Whether a causal LM's pipeline layers reproduce its own forward, and what lets them be called one tensor at a
time: the arguments the model's trunk passes each decoder layer, found by running the trunk's forward on
stand-ins (`_trunk_kwargs`); the hooks that hand them to a layer the pipeline calls with the hidden states alone
(`_PipelineCalls`); and the check of the decomposition against the model's own forward (`check_decomposition`)."""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections import OrderedDict
from typing import Any, ContextManager, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_hybrid.core.batch import document_ids, is_packed
from lightning_hybrid.hf.document_attention import VERIFIED_PREFIX, first_packed_stance
from lightning_hybrid.hf.structure import PipelineDecompositionError, _embedding_dim, _Structure

__all__ = ["PipelineDecompositionError", "check_decomposition", "check_document_masks"]

_CHECK_TOKENS = 8  # the decomposition check's sequence length
_CHECK_VOCAB = 16  # rows of the embedding / head stand-ins in that check


class _Stop(Exception):
    pass


class _Standin(nn.Module):
    """In a shell of the trunk: a layer that only records what it is called with (the last one stops the
    forward), or a prologue / epilogue module without weights (an embedding gives zeros, others pass on)."""

    def __init__(self, kind: str, dim: int = 0, calls: Optional[list] = None, last: bool = False,
                 dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.kind, self.dim, self.calls, self.last, self.dtype = kind, dim, calls, last, dtype

    def forward(self, *args, **kwargs):
        if self.kind == "layer":
            assert self.calls is not None
            self.calls.append((args[1:], kwargs))
            if self.last:
                raise _Stop
            return args[0]
        first = args[0] if args else next(iter(kwargs.values()))
        if self.kind == "embedding":
            return torch.zeros(*first.shape, self.dim, device=first.device, dtype=self.dtype)
        return first


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def _shell(module: nn.Module, replace: dict[str, nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` whose children ``replace`` names are others, without the module's hooks
    (those of TP verification, FSDP2 ...); nothing is copied or moved."""
    shell = copy.copy(module)
    shell._modules = dict(module._modules)
    shell._modules.update(replace)
    for name in _HOOK_DICTS:
        if name in shell.__dict__:
            setattr(shell, name, OrderedDict())
    return shell


def _trunk_kwargs(
    structure: _Structure, hidden: Tensor, position_ids: Optional[Tensor] = None
) -> list[tuple[tuple, dict]]:
    """The extra arguments (beyond the hidden states) the model's trunk passes each decoder layer, for an
    input of ``hidden``'s shape, dtype and device (and ``position_ids``, of a padded or packed batch): the
    trunk's own forward run on stand-ins."""
    trunk = structure.trunk
    calls: list = []
    n = len(getattr(trunk, structure.layers_name))
    standins = nn.ModuleList([_Standin("layer", calls=calls, last=i == n - 1) for i in range(n)])
    replace: dict[str, nn.Module] = {structure.layers_name: standins}
    for name in structure.prologue + structure.epilogue:
        dim = structure.embeddings.get(name)
        replace[name] = _Standin("embedding", dim=dim, dtype=hidden.dtype) if dim else _Standin("pass")
    shell = _shell(trunk, replace)
    positions = {} if position_ids is None else {"position_ids": position_ids}
    try:
        shell(inputs_embeds=torch.zeros_like(hidden), use_cache=False, **positions)
    except _Stop:
        pass
    if len(calls) != n:
        raise PipelineDecompositionError(
            f"the forward of {type(trunk).__name__} called {len(calls)} of its {n} decoder layers on stand-ins."
        )
    return calls


# ---------------------------------------------------------------------------------------------- hooks
class _PipelineCalls:
    """The hooks that let the model's modules be called as pipeline layers with one tensor."""

    #: Input shapes whose decoder-layer arguments are kept (the most recent ones: training and evaluation
    #: micro-batches; variable-length data would otherwise grow the cache without end).
    CACHED_SHAPES = 8

    def __init__(self, structure: _Structure) -> None:
        self.structure = structure
        # Under sequence parallelism a decoder layer receives 1/sequence_split of the sequence; its arguments
        # (rotary tables, masks) are those of the whole sequence, which its attention gathers.
        self.sequence_split = 1
        self._cache: "OrderedDict[tuple, tuple[Optional[Tensor], list]]" = OrderedDict()
        self.documents_checked = False  # whether `check_document_masks` passed
        self._hooked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._handles: list = []  # of the hooks installed, to remove them from a model its layers cannot reproduce
        self._filled: set[int] = set()
        self._decoder_index: dict[int, int] = {}  # id of a hooked decoder layer -> its index in the trunk
        self._ready: Optional[tuple[tuple, dict]] = None  # the next decoder layer call's arguments (`around`)
        self._used: Optional[tuple[tuple, dict]] = None  # those the hook computed last
        self._plain: dict[tuple, tuple[tuple, dict]] = {}  # (layer, input's shape, dtype, device) -> its arguments
        self._packed: Optional[tuple[Tensor, bool]] = None  # the last micro-batch's positions, and whether packed

    def kwargs_for(self, index: int, hidden: Tensor, position_ids: Optional[Tensor] = None) -> tuple[tuple, dict]:
        """Decoder layer ``index``'s arguments for ``hidden`` (at ``position_ids``: those of a padded or packed
        micro-batch, kept while that very tensor is in use: the layers of a stage share it)."""
        shape = (hidden.size(0), hidden.size(1) * self.sequence_split, *hidden.shape[2:])
        return self._arguments(index, shape, hidden.dtype, hidden.device, position_ids)

    def _arguments(self, index: int, shape: tuple, dtype: torch.dtype, device: torch.device,
                   position_ids: Optional[Tensor]) -> tuple[tuple, dict]:
        """`kwargs_for` of the whole sequence's hidden states' ``shape``, ``dtype`` and ``device``."""
        key = (shape[:-1], dtype, device, None if position_ids is None else id(position_ids))
        cached = self._cache.get(key)
        if cached is None or cached[0] is not position_ids:
            if position_ids is not None and not self.documents_checked:
                check_document_masks(self.structure, device)
                self.documents_checked = True
            with torch.no_grad():
                cached = (position_ids, _trunk_kwargs(self.structure, torch.zeros(shape, dtype=dtype, device=device),
                                                      position_ids))
            self._cache[key] = cached
            while len(self._cache) > self.CACHED_SHAPES:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return cached[1][index]

    def around(self, layer: nn.Module, hidden: Tensor, position_ids: Optional[Tensor],
               attention: Any) -> ContextManager:
        """Around a pipeline's call of ``layer`` on ``hidden``, out of the layer -- so out of its compiled code, where
        running the trunk on stand-ins would break the layer's graph: a decoder layer's other arguments, for its hook
        to read. With ``position_ids`` (a new tensor each micro-batch) computed here, for the whole sequence, the
        positions' shape (``hidden`` may be whole or split by sequence parallelism), and the layer's first packed call
        run eagerly (`first_packed_stance`: ``attention`` verifies it), as `CausalLM.forward` does for the whole
        model; without, those of the layer's first call at ``hidden``'s shape, which runs eagerly."""
        index = self._decoder_index.get(id(layer))
        if index is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        if position_ids is not None:
            ready = self._arguments(index, (*position_ids.shape, hidden.size(-1)), hidden.dtype, hidden.device,
                                    position_ids)
            stack.enter_context(first_packed_stance(attention, position_ids, layer, self._is_packed))
        else:
            key = (id(layer), tuple(hidden.shape), hidden.dtype, hidden.device)
            ready = self._plain.get(key)
            if ready is None:  # the hook computes them, eagerly, and they are kept (`_keep`)
                stack.enter_context(torch.compiler.set_stance("force_eager"))
                stack.callback(self._keep, key)
        self._ready = ready
        stack.callback(setattr, self, "_ready", None)
        return stack

    def _is_packed(self, position_ids: Tensor) -> bool:
        """`is_packed` once a micro-batch (its layers share its ``position_ids``): one host sync, not one a layer."""
        if self._packed is None or self._packed[0] is not position_ids:
            self._packed = (position_ids, is_packed(position_ids))
        return self._packed[1]

    def _keep(self, key: tuple) -> None:
        """Keep the arguments the hook just computed for ``key`` (layer, input shape, dtype, device)."""
        if self._used is not None:
            self._plain[key] = self._used
            while len(self._plain) > self.CACHED_SHAPES * max(len(self._decoder_index), 1):
                self._plain.pop(next(iter(self._plain)))
        self._used = None

    def install(self, layers: list[nn.Module]) -> None:
        s = self.structure
        n_pro = len(s.prologue)
        n_layers = len(getattr(s.trunk, s.layers_name))
        for i, layer in enumerate(layers):
            if layer in self._hooked:
                continue
            if n_pro <= i < n_pro + n_layers:
                self._hook_decoder_layer(layer, i - n_pro)
                self._decoder_index[id(layer)] = i - n_pro
            elif 0 < i < n_pro and s.prologue[i] in s.embeddings:
                self._hook_position_embedding(layer)
            else:
                self._hook_plain_layer(layer)
            self._hooked.add(layer)

    def uninstall(self) -> None:
        """Remove every hook `install` put on the layers (the model's own forward is then exactly its own)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooked = weakref.WeakSet()
        self._decoder_index, self._plain = {}, {}

    def _hook_decoder_layer(self, layer: nn.Module, index: int) -> None:
        def pre(module, args, kwargs):
            if len(args) != 1 or set(kwargs) - {"position_ids"}:
                return None  # the model's own forward: it passes the arguments itself
            ready = self._ready
            if ready is None:
                ready = self._used = self.kwargs_for(index, args[0], kwargs.get("position_ids"))
            rest, extra = ready
            self._filled.add(id(module))
            return (args[0], *rest), dict(extra)

        def post(module, args, kwargs, output):
            if id(module) in self._filled:
                self._filled.discard(id(module))
                return output[0] if isinstance(output, tuple) else output
            return None

        self._handles += [
            layer.register_forward_pre_hook(pre, with_kwargs=True),
            layer.register_forward_hook(post, with_kwargs=True),
        ]

    def _hook_position_embedding(self, layer: nn.Module) -> None:
        stash: list[Tensor] = []

        def pre(module, args, kwargs):
            hidden = args[0] if len(args) == 1 else None
            if not (isinstance(hidden, Tensor) and hidden.is_floating_point()) or set(kwargs) - {"position_ids"}:
                return None
            stash.append(hidden)
            positions = kwargs.get("position_ids")
            if positions is None:
                positions = torch.arange(hidden.size(1), device=hidden.device).unsqueeze(0)
            return (positions,), {}

        def post(module, args, output):
            if stash:
                return stash.pop() + output
            return None

        self._handles += [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post)]

    def _hook_plain_layer(self, layer: nn.Module) -> None:
        """The token embedding, final norm and head take the hidden states alone: the side inputs the pipeline
        hands every layer are left out."""

        def pre(module, args, kwargs):
            if len(args) == 1 and set(kwargs) == {"position_ids"}:
                return args, {}
            return None

        self._handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))


# ---------------------------------------------------------------------------------------------- the check
def _standin_copy(module: nn.Module, generator: torch.Generator, head: bool = False) -> nn.Module:
    """A small materialised stand-in of a prologue / epilogue / head module with the same class, hooks and
    behaviour (in eval mode): embeddings and the head keep `_CHECK_VOCAB` rows, other modules their shapes
    (norms: the hidden size). The module itself is left as it is."""
    out = copy.copy(module)
    out.training = False
    out._parameters = dict(module._parameters)
    out._buffers = dict(module._buffers)
    out._modules = {n: _standin_copy(c, generator) for n, c in module._modules.items()}
    rows = None
    if _embedding_dim(module):
        rows = _CHECK_VOCAB
        out.padding_idx = None
        out.num_embeddings = rows
    elif head:
        rows = _CHECK_VOCAB
        if hasattr(out, "out_features"):
            out.out_features = rows
    for name, p in module._parameters.items():
        if p is None:
            continue
        shape = list(p.shape)
        if rows is not None and shape:
            shape[0] = min(shape[0], rows)
        t = torch.randn(shape, generator=generator, device=generator.device) * 0.5
        t = t + (1.0 if p.dim() == 1 and "weight" in name else 0.0)
        out._parameters[name] = nn.Parameter(t, requires_grad=False)
    for name, b in module._buffers.items():
        if b is not None and b.is_meta:
            out._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=generator.device)
    return out


def check_decomposition(model: nn.Module, structure: _Structure) -> None:
    """`PipelineDecompositionError` unless the prologue modules applied in order give what the model's trunk
    hands its first decoder layer, and the epilogue modules and head give the model's logits from what its
    last decoder layer returns -- both on small random stand-ins of those modules (same classes and hooks)."""
    try:
        # The stand-ins are on the CPU, whatever the ambient device (Lightning's init context).
        with torch.device("cpu"):
            _check_decomposition(model, structure)
    except PipelineDecompositionError:
        raise
    except Exception as e:  # the model's code does not run on its layers as the pipeline calls them
        raise PipelineDecompositionError(
            f"{type(model).__name__} cannot be cut into pipeline layers exactly: applying its modules"
            f" {structure.layer_names()[:2]}...{structure.layer_names()[-2:]} in order fails ({type(e).__name__}: {e})."
        ) from e


def _check_decomposition(model: nn.Module, s: _Structure) -> None:
    generator = torch.Generator(device="cpu").manual_seed(0)
    trunk = s.trunk
    pro = {n: _standin_copy(getattr(trunk, n), generator) for n in s.prologue}
    epi = {n: _standin_copy(getattr(trunk, n), generator) for n in s.epilogue}
    head = _standin_copy(getattr(model, s.head_name), generator, head=True)
    ids = torch.randint(0, _CHECK_VOCAB, (2, _CHECK_TOKENS), generator=generator, device=generator.device)
    n = len(getattr(trunk, s.layers_name))
    with torch.no_grad():
        # Prologue: the model's own forward up to its first decoder layer ...
        seen: list = []

        class First(nn.Module):
            def forward(self, hidden, *args, **kwargs):
                seen.append(hidden)
                raise _Stop

        try:
            shell = _shell(trunk, {s.layers_name: nn.ModuleList([First() for _ in range(n)]), **pro, **epi})
            shell(input_ids=ids, use_cache=False)
        except _Stop:
            pass
        # ... against the prologue modules in order (as the pipeline calls them, hooks included).
        x: Any = ids
        for name in s.prologue:
            x = pro[name](x)
        if len(seen) != 1 or not isinstance(x, Tensor) or x.shape != seen[0].shape or not torch.equal(seen[0], x):
            raise PipelineDecompositionError(
                f"{type(model).__name__}: its forward does more between {s.prologue} and its first decoder layer"
                " than those modules do (e.g. a scaling of the embeddings), so its pipeline layers would not"
                " reproduce it."
            )
        # Epilogue: whatever the last decoder layer returns, the model's logits from it ...
        last = torch.randn(*x.shape, generator=generator, device=generator.device)
        y: Any = last
        for name in s.epilogue:
            y = epi[name](y)
        got = head(y)
        want = None
        for as_tuple in (False, True):  # a decoder layer returns its hidden states, or a tuple of them first
            try:
                want = _logits_from_last_layer(model, s, pro, epi, head, ids, last, as_tuple)
                break
            except Exception:
                if as_tuple:
                    raise
        if want is None or want.shape != got.shape or not torch.equal(want, got):
            raise PipelineDecompositionError(
                f"{type(model).__name__}: its forward does more after its last decoder layer than {s.epilogue}"
                f" and {s.head_name} do (e.g. a scaling or soft cap of the logits), so its pipeline layers would"
                " not reproduce it."
            )


def _logits_from_last_layer(model, s: _Structure, pro, epi, head, ids: Tensor, last: Tensor, as_tuple: bool) -> Tensor:
    """The model's own logits when every decoder layer returns ``last``, on shells holding the stand-ins."""

    class Inject(nn.Module):
        def forward(self, hidden, *args, **kwargs):
            return (last,) if as_tuple else last

    n = len(getattr(s.trunk, s.layers_name))
    root = _shell(model, {s.head_name: head})
    owner = root
    for i, name in enumerate(s.path):  # shells along the path to the trunk
        if i == len(s.path) - 1:
            child = _shell(s.trunk, {s.layers_name: nn.ModuleList([Inject() for _ in range(n)]), **pro, **epi})
        else:
            child = _shell(owner._modules[name], {})
        owner._modules[name] = child
        owner = child
    # A mixture-of-experts model that adds its routers' loss would compute it from no router logits (the stand-ins
    # route nothing) and fail: its logits are what is compared here.
    routers = {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}
    return root(input_ids=ids, use_cache=False, **routers).logits


# ---------------------------------------------------------------------------------------------- document masks
_CHECK_POSITIONS = (0, 1, 2, 0, 1, 0, 1, 2)  # three packed documents


def check_document_masks(structure: _Structure, device: torch.device) -> None:
    """``ValueError`` unless, for packed ``position_ids`` (several documents in a row, as padded and packed batches
    give them, `lightning_hybrid.core.batch`), the attention mask the model's own code hands every decoder layer lets
    no token see another document's, nor a later token: the trunk's forward run on stand-ins, its masks read. An
    implementation that takes no dense mask is checked by running it instead
    (`lightning_hybrid.hf.document_attention.VerifiedAttention`, on the first packed batch)."""
    model = structure.model
    name = type(model).__name__
    hidden_size = next(iter(structure.embeddings.values()))
    positions = torch.tensor([_CHECK_POSITIONS], device=device)
    n = positions.size(1)
    docs = document_ids(positions)[0]
    allowed = (docs[:, None] == docs[None, :]) & torch.ones(n, n, dtype=torch.bool, device=device).tril()
    try:
        with torch.no_grad():
            calls = _trunk_kwargs(structure, torch.zeros(1, n, hidden_size, device=device), positions)
    except TypeError as e:
        raise ValueError(
            f"{name} does not take position_ids ({e}), so padded or packed batches cannot reach it: train it on"
            " (x, y) batches or dict batches without attention_mask and position_ids."
        ) from e
    attn = getattr(model.config, "_attn_implementation", None)
    for i, (args, kwargs) in enumerate(calls):
        masks = [t for t in tree_leaves((args, kwargs))
                 if isinstance(t, Tensor) and t.dim() == 4 and tuple(t.shape[-2:]) == (n, n)]
        if not masks and attn is not None and attn.startswith(VERIFIED_PREFIX):
            continue  # an implementation that takes no dense mask: verified on the first packed batch it runs
        if not masks:
            raise ValueError(
                f"{name} (attn_implementation={attn!r}) hands decoder layer {i} no attention mask built from"
                " position_ids, so packed documents (or left padding) would see each other: train it on unpacked"
                " batches padded on the right only" + ("" if attn in ("sdpa", "eager") else
                                                      ", or with attn_implementation='sdpa'") + "."
            )
        for mask in masks:
            attend = mask if mask.dtype == torch.bool else mask == 0
            if bool((attend[0, 0] & ~allowed).any()):
                raise ValueError(
                    f"{name}'s attention mask for packed position_ids lets tokens of decoder layer {i} see another"
                    " document or a later token, so packed documents (or left padding) would see each other: train"
                    " it on unpacked batches padded on the right only."
                )
