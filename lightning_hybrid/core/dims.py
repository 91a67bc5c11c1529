"""Every layout size in one place, and every named view of the ranks built once from them.

`ParallelDims` holds the sizes of all dimensions -- ``pp``, ``dp``, ``cp``, ``ep``, ``tp`` -- validates them (alone
when the strategy is built, before any process exists; against the world size once it is known) and builds
`Meshes`, the named process-group views every dimension reads. Nothing else keeps a size: the options
(`lightning_hybrid.options.ParallelOptions`) hold only what is not one, and the dimensions are handed their mesh.

The ranks, outermost first: ``pp``, then the ``dp * cp`` ranks over which gradients are reduced and ZeRO shards
(``"dp_cp"``: context-parallel ranks hold other tokens of the same samples, so for everything but the data they are
data-parallel ranks, as TorchTitan's ``dp_shard_cp``), then ``tp`` innermost (adjacent ranks: one node's links).
A gradient rank ``g`` is ``(dp, cp) = divmod(g, cp)`` (``"dp"``: ranks with other samples; ``"cp"``: the ranks that
split each sequence) and ``(edp, ep) = divmod(g, ep)`` (``"ep"``: the ranks that split each experts module;
``"edp"``: those holding the same experts). ``dp`` itself is ``dp_replicate * dp_shard``: ZeRO-3 shards over the
``dp_shard * cp`` ranks of a gradient group (``"dp_shard_cp"``) and, where ``dp_shard < dp`` (hybrid sharding, HSDP),
replicates over the ``dp_replicate`` such groups (``"dp_replicate"``); ``"fsdp"`` is the mesh ZeRO-3 shards over:
``dp_cp`` itself, or the 2-D ``(dp_replicate, dp_shard_cp)`` mesh FSDP2 takes for HSDP. A gradient rank ``g`` is
also ``(dp_replicate, dp_shard_cp) = divmod(g, dp_shard * cp)``.

torch 2.13 has no public API to view one dimension of a mesh as several; ``DeviceMesh._unflatten`` (what
TorchTitan's ``ParallelDims.build_mesh`` uses) is called here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("pp", "dp_cp", "tp")
ZERO_STAGES = (0, 1, 2, 3)
#: Every size, in the order of `ParallelDims`' fields.
SIZES = ("pp", "dp", "cp", "ep", "tp", "dp_shard")


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of every dimension; ``dp=-1`` (requested) is ``world_size // (pp * cp * tp)`` once resolved
    (`for_world`). ``ep`` splits experts over ranks carved out of the ``dp * cp`` gradient ranks: it divides them.
    ``dp_shard`` (ZeRO-3's shard groups: HSDP where it is less than ``dp``) divides ``dp``; ``None`` is ``dp``.
    ``world_size`` is ``None`` until resolved."""

    pp: int = 1
    dp: int = -1
    cp: int = 1
    ep: int = 1
    tp: int = 1
    dp_shard: Optional[int] = None
    world_size: Optional[int] = None

    @classmethod
    def request(cls, dp: int = -1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                dp_shard: Optional[int] = None) -> "ParallelDims":
        """The sizes a user asked for, each checked on its own (``ep`` and ``dp_shard`` also against ``dp`` where
        it is given); ``ValueError`` naming the bad value and what would be valid."""
        for name, value in (("tp", tp), ("pp", pp)):
            if not _positive(value):
                raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer.")
        if not (_positive(dp) or dp == -1) or isinstance(dp, bool):
            raise ValueError(f"dp={dp!r} is invalid: it must be a positive integer or -1 (infer from the world size).")
        if not _positive(cp):
            raise ValueError(f"cp={cp!r} is invalid: it must be a positive integer (1: no context parallelism).")
        if not _positive(ep):
            raise ValueError(f"ep={ep!r} is invalid: it must be a positive integer (1: no expert parallelism).")
        if dp_shard is not None and not _positive(dp_shard):
            raise ValueError(f"dp_shard={dp_shard!r} is invalid: it must be a positive integer (the ranks of one ZeRO-3"
                             " shard group) or None (shard over the whole dp).")
        dims = cls(pp=pp, dp=dp, cp=cp, ep=ep, tp=tp, dp_shard=dp_shard)
        if dp != -1:
            dims._check_ep()
            dims._check_dp_shard()
        return dims

    @classmethod
    def resolve(cls, dp: int, tp: int, pp: int, world_size: int, cp: int = 1, ep: int = 1,
                dp_shard: Optional[int] = None) -> "ParallelDims":
        """`request` and `for_world` at once."""
        return cls.request(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dp_shard=dp_shard).for_world(world_size)

    def for_world(self, world_size: int) -> "ParallelDims":
        """These sizes on ``world_size`` ranks (``dp=-1`` inferred); ``ValueError`` where they do not fit it."""
        others = self.tp * self.pp * self.cp
        named, sizes = ("tp*pp", f"{self.tp}*{self.pp}") if self.cp == 1 else (
            "tp*pp*cp", f"{self.tp}*{self.pp}*{self.cp}")
        dp = self.dp
        if dp == -1:
            if world_size % others != 0:
                raise ValueError(
                    f"The world size {world_size} is not divisible by {named} = {sizes} = {others}, so dp cannot be"
                    f" inferred. Valid {named} for this world size are its divisors: {divisors(world_size)}."
                )
            dp = world_size // others
        if dp * others != world_size:
            raise ValueError(
                f"dp*{named} = {dp}*{sizes} = {dp * others} does not equal the world size {world_size}."
                f" Choose sizes whose product is {world_size} (or dp=-1 to infer dp)."
            )
        dims = replace(self, dp=dp, world_size=world_size)
        dims._check_ep()
        dims._check_dp_shard()
        return dims

    def _check_dp_shard(self) -> None:
        if self.dp_shard is not None and self.dp % self.dp_shard:
            raise ValueError(
                f"dp_shard={self.dp_shard} does not divide dp={self.dp}: ZeRO-3 shards within groups of dp_shard"
                f" data-parallel ranks and replicates across dp / dp_shard of them. Valid dp_shard for dp={self.dp}:"
                f" {divisors(self.dp)} (dp itself, or None: no hybrid sharding)."
            )

    @property
    def shard_size(self) -> int:
        """ZeRO-3's data-parallel shard group (``dp`` unless hybrid)."""
        return self.dp if self.dp_shard is None else self.dp_shard

    @property
    def dp_replicate(self) -> int:
        """The replicas of each ZeRO-3 shard group (1 unless hybrid)."""
        return self.dp // self.shard_size

    @property
    def hybrid(self) -> bool:
        """Whether ZeRO-3 shards within groups and replicates across them (HSDP)."""
        return self.dp_replicate > 1

    def _check_ep(self) -> None:
        ranks = self.dp * self.cp
        if ranks % self.ep:
            named = "dp" if self.cp == 1 else "dp*cp"
            raise ValueError(
                f"ep={self.ep} does not divide {named}={ranks}: the expert-parallel ranks are carved out of the"
                f" data-parallel ones. Valid ep for {named}={ranks}: {divisors(ranks)}."
            )

    @property
    def resolved(self) -> bool:
        return self.world_size is not None

    @property
    def shape(self) -> tuple[int, int, int]:
        """The world mesh's ``(pp, dp_cp, tp)``: its middle dimension holds the ``dp * cp`` gradient ranks."""
        return (self.pp, self.dp * self.cp, self.tp)

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """Global ``rank``'s place ``(pp, dp, cp, tp)`` (TP innermost, CP inside the gradient ranks)."""
        pp, rest = divmod(rank, self.dp * self.cp * self.tp)
        gradient_rank, tp = divmod(rest, self.tp)
        dp, cp = divmod(gradient_rank, self.cp)
        return pp, dp, cp, tp

    def build_meshes(self, device_type: str) -> "Meshes":
        """Every named view of the ranks over the default process group (which must be initialised), built once.
        Collective: every rank creates the same groups in the same order."""
        if not self.resolved:
            raise RuntimeError("The sizes must be resolved against the world size (`for_world`) before the meshes.")
        if not dist.is_initialized():
            raise RuntimeError("The default process group must be initialised before the device mesh is built.")
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"Process group has {dist.get_world_size()} ranks, the layout expects"
                               f" {self.world_size}.")
        world = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)
        views: dict[str, DeviceMesh] = {name: world[name] for name in MESH_DIM_NAMES}
        views["dp"] = views["dp_cp"]
        if self.cp > 1:
            context = world._unflatten("dp_cp", (self.dp, self.cp), ("dp", "cp"))
            views["dp"], views["cp"] = context["dp"], context["cp"]
        if self.ep > 1:
            expert = world._unflatten("dp_cp", (self.dp * self.cp // self.ep, self.ep), ("edp", "ep"))
            views["edp"], views["ep"] = expert["edp"], expert["ep"]
        views["dp_shard_cp"] = views["fsdp"] = views["dp_cp"]
        if self.hybrid:
            shard = self.shard_size * self.cp
            hybrid = world._unflatten("dp_cp", (self.dp_replicate, shard), ("dp_replicate", "dp_shard_cp"))
            views["dp_replicate"], views["dp_shard_cp"] = hybrid["dp_replicate"], hybrid["dp_shard_cp"]
            views["fsdp"] = hybrid["dp_replicate", "dp_shard_cp"]
        return Meshes(self, world, views)


@dataclass(frozen=True)
class Meshes:
    """The named views of the ranks (`ParallelDims.build_meshes`): ``meshes["tp"]``, ``["pp"]``, ``["dp_cp"]`` (the
    gradient ranks: DDP's reduction, ZeRO's shards), ``["dp"]`` (the ranks with other samples), and where the
    dimension is on: ``["cp"]``, ``["ep"]`` and ``["edp"]``; ``["dp_shard_cp"]`` (the ranks one ZeRO-3 shard is split
    over) and ``["fsdp"]`` (the mesh ZeRO-3 shards over: 1-D, or with ``["dp_replicate"]`` the 2-D HSDP mesh).
    ``world``: the ``(pp, dp_cp, tp)`` mesh (what a LightningModule sees as its ``device_mesh``)."""

    dims: ParallelDims
    world: DeviceMesh
    views: Mapping[str, DeviceMesh]

    def __getitem__(self, name: str) -> DeviceMesh:
        try:
            return self.views[name]
        except KeyError:
            where = "cp, ep and edp exist where cp > 1 or ep > 1, dp_replicate where dp_shard < dp"
            raise KeyError(f"No {name!r} mesh in this layout ({self.dims}): the meshes are {sorted(self.views)}"
                           f" ({where}).") from None

    def __contains__(self, name: str) -> bool:
        return name in self.views

    def group(self, name: str) -> dist.ProcessGroup:
        return self[name].get_group()

    def size(self, name: str) -> int:
        return self[name].size()

    def local_rank(self, name: str) -> int:
        return self[name].get_local_rank()


def validate_zero_stage(stage: int) -> int:
    if stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage={stage!r} is invalid: valid stages are {list(ZERO_STAGES)}.")
    return stage


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def barrier(device: torch.device) -> None:
    """A barrier over the default process group; NCCL's names the device, so that it does not guess one."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def after_rank_zero(device: torch.device, what: str, work: Callable[[], object]) -> None:
    """``work()`` on global rank 0 (a file it alone writes), then every rank meets: where a barrier would leave the
    others waiting for a rank 0 whose work raised, they learn of it (`rank_zero_verdict`)."""
    error: Optional[Exception] = None
    if dist.get_rank() == 0:
        try:
            work()
        except Exception as e:  # told to every rank below, then raised here
            error = e
    rank_zero_verdict(device, what, error)


def rank_zero_verdict(device: torch.device, what: str, error: Optional[Exception]) -> None:
    """Every rank meets (one broadcast from global rank 0 of its ``error``'s text, ``None`` when its part of
    ``what`` went well): rank 0 raises its ``error``, the others a ``RuntimeError`` naming it."""
    verdict = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(verdict, 0, device=device if dist.get_backend() == "nccl" else None)
    if error is not None:
        raise error
    if verdict[0] is not None:
        raise RuntimeError(f"rank 0 failed in {what}: {verdict[0]}")


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def layout_size(strategy: object, name: str) -> int:
    """The size ``name`` (``"tp"``, ``"cp"``, ``"ep"``, ...) of a strategy's layout (`MeshStrategy.parallel_dims`),
    1 for a strategy without one: what a module reads to adapt to the layout it runs under."""
    if name not in SIZES:
        raise ValueError(f"{name!r} is not a size of the layout: the sizes are {list(SIZES)}.")
    dims = getattr(strategy, "parallel_dims", None)
    if not isinstance(dims, ParallelDims):
        return 1
    return int(dims.shard_size if name == "dp_shard" else getattr(dims, name))
