"""The device mesh: sizes, their validation, and the `DeviceMesh` built from them.

`ParallelDims` is the one place where layout sizes are checked. It is a frozen value: the strategy builds it
once it knows the world size, builds the mesh from it, and hands sub-meshes (or their process groups) to
the tensor-parallel layers, the ZeRO optimizer and the pipeline executor. Nothing here is global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("pp", "dp", "tp")
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the mesh dimensions ``(pp, dp, cp, tp)``; TP innermost (adjacent ranks), PP outermost.

    ``dp=-1`` means "whatever the world size leaves": ``world_size // (tp * pp * cp)``. Context parallelism's
    ranks hold other tokens of the same samples, so for everything but the data they are data-parallel ranks: the
    mesh's ``"dp"`` dimension holds the ``dp * cp`` ranks over which gradients are reduced and ZeRO shards (as
    TorchTitan's ``dp_shard_cp``), and `build_context_mesh` views it as ``("batch", "cp")``.
    """

    dp: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1

    @staticmethod
    def check_sizes(dp: int, tp: int, pp: int) -> None:
        """Each size on its own (no world size yet): positive integers, ``dp`` may be -1. Raises ``ValueError``."""
        for name, value in (("tp", tp), ("pp", pp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: it must be a positive integer.")
        if not isinstance(dp, int) or (dp < 1 and dp != -1):
            raise ValueError(f"dp={dp!r} is invalid: it must be a positive integer or -1 (infer from the world size).")

    @staticmethod
    def check_ep(ep: int, dp: int) -> None:
        """The expert-parallel size on its own and against a given ``dp`` (``-1``: checked once it is known, by
        `check_ep_divides`). Raises ``ValueError``."""
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            raise ValueError(f"ep={ep!r} is invalid: it must be a positive integer (1: no expert parallelism).")
        if dp != -1:
            ParallelDims.check_ep_divides(ep, dp)

    @staticmethod
    def check_ep_divides(ep: int, dp: int) -> None:
        if dp % ep:
            raise ValueError(
                f"ep={ep} does not divide dp={dp}: the expert-parallel ranks are carved out of the data-parallel ones."
                f" Valid ep for dp={dp}: {divisors(dp)}."
            )

    @staticmethod
    def check_cp(cp: int) -> None:
        if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
            raise ValueError(f"cp={cp!r} is invalid: it must be a positive integer (1: no context parallelism).")

    @classmethod
    def resolve(cls, dp: int, tp: int, pp: int, world_size: int, cp: int = 1) -> "ParallelDims":
        """Validate the requested sizes against ``world_size`` and infer ``dp=-1``. Raises ``ValueError``."""
        cls.check_sizes(dp, tp, pp)
        cls.check_cp(cp)
        others, named = tp * pp * cp, ("tp*pp" if cp == 1 else "tp*pp*cp")
        sizes = f"{tp}*{pp}" if cp == 1 else f"{tp}*{pp}*{cp}"
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
        return cls(dp=dp, tp=tp, pp=pp, world_size=world_size, cp=cp)

    @property
    def shape(self) -> tuple[int, int, int]:
        """The mesh's ``(pp, dp, tp)``: its ``"dp"`` dimension holds the ``dp * cp`` ranks of the gradients."""
        return (self.pp, self.dp * self.cp, self.tp)

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """Global ``rank``'s place ``(pp, dp, cp, tp)`` in the mesh (TP innermost, CP inside the mesh's ``"dp"``)."""
        pp, rest = divmod(rank, self.dp * self.cp * self.tp)
        gradient_rank, tp = divmod(rest, self.tp)
        dp, cp = divmod(gradient_rank, self.cp)
        return pp, dp, cp, tp

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the ``(pp, dp * cp, tp)`` mesh over the default process group (which must be initialised)."""
        if not dist.is_initialized():
            raise RuntimeError("The default process group must be initialised before the device mesh is built.")
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(f"Process group has {dist.get_world_size()} ranks, the layout expects"
                               f" {self.world_size}.")
        return init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)


def build_expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The ``(pp, edp, ep, tp)`` view of the ``(pp, dp, tp)`` ``mesh``: data-parallel rank ``d`` is
    ``(edp, e) = divmod(d, ep)``; ``mesh["ep"]`` groups the ranks that split the experts (and exchange tokens),
    ``mesh["edp"]`` the ranks holding the same experts (their gradients' data-parallel group). Collective (it
    creates the two groups)."""
    dp = mesh["dp"].size()
    ParallelDims.check_ep_divides(ep, dp)
    return mesh._unflatten("dp", (dp // ep, ep), ("edp", "ep"))


def build_context_mesh(mesh: DeviceMesh, cp: int) -> DeviceMesh:
    """The ``(pp, batch, cp, tp)`` view of the ``(pp, dp * cp, tp)`` ``mesh``: gradient rank ``d`` is
    ``(batch, c) = divmod(d, cp)``; ``mesh["cp"]`` groups the ranks that split each sequence, ``mesh["batch"]`` the
    ranks with other samples. Collective (it creates the groups)."""
    return mesh._unflatten("dp", (mesh["dp"].size() // cp, cp), ("batch", "cp"))


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
