"""What an architecture is: a pure driver-side description plus a worker-side trainer.

Driver side (no torch.distributed, no Ray): check the spec, describe where state lives.
Worker side (`Trainer`): build the model in the current process group, run one step, hand out
and take back this rank's state.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from architectures import state
from failbench_ray.data import SyntheticData
from failbench_ray.errors import SpecError
from failbench_ray.models import loss_fn

if TYPE_CHECKING:
    from failbench_ray.comm import AbortHandle
    from failbench_ray.spec import ExperimentSpec


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class StateLayout:
    """Where training state lives. Ranks holding the same shard id form a replica group."""

    shard_of_rank: tuple[int, ...]
    holds: tuple[str, ...]  # per rank, in words: "full replica", "shard 2/4", "stage 1/4", ...

    @property
    def world_size(self) -> int:
        return len(self.shard_of_rank)

    def shard_ids(self) -> list[int]:
        return sorted(set(self.shard_of_rank))

    def replica_groups(self) -> list[list[int]]:
        return [
            [r for r, s in enumerate(self.shard_of_rank) if s == shard]
            for shard in self.shard_ids()
        ]

    def writer_of(self, shard: int) -> int:
        """The rank that persists a shard: the lowest rank holding it."""
        return self.shard_of_rank.index(shard)

    def orphaned_shards(self, dead: set[int]) -> list[int]:
        """Shards with no surviving holder."""
        return [g[0] for g in self._groups_by_shard() if set(g[1]) <= dead]

    def _groups_by_shard(self) -> list[tuple[int, list[int]]]:
        return list(zip(self.shard_ids(), self.replica_groups(), strict=True))


@dataclass(frozen=True)
class StepOutput:
    loss: float  # NaN on a rank that never sees the loss (an inner pipeline stage)
    samples: int  # samples this rank's data-parallel replica consumed


@dataclass
class WorkerContext:
    spec: ExperimentSpec
    params: Any  # the architecture's own Params instance
    rank: int  # logical rank: the rank's identity and data shard, kept across re-formations
    world_size: int  # logical world (the spec's)
    device: torch.device
    group: Any  # torch.distributed.ProcessGroup of the live members
    abort: AbortHandle
    members: tuple[int, ...] = ()  # live logical ranks, in group-rank order
    peers: dict[int, Any] = field(default_factory=dict)  # rank -> worker actor handle
    # Which part of each global batch this rank trains on: its logical rank of the spec's
    # world, unless the mechanism re-balances the data over the live members (elastic).
    data_index: int | None = None
    data_count: int | None = None

    @property
    def data_part(self) -> tuple[int, int]:
        if self.data_index is None or self.data_count is None:
            return self.rank, self.world_size
        return self.data_index, self.data_count

    @property
    def group_rank(self) -> int:
        return self.members.index(self.rank)


class Trainer(ABC):
    """One rank's training process for one generation of the process group.

    Subclasses build `self.module` (this rank's part of the model) and `self.optimizer`; state
    hand-over and the digest work on their local tensors, whatever the parallelism.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    data: SyntheticData

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def train_step(self, step: int) -> StepOutput:
        """One optimizer step; raise CollectiveAborted (before the update) if a peer died."""

    def serve(self, request: Any) -> Any:
        """Answer a peer's request (a typed message of the architecture's own, e.g. a
        parameter server's `Push`), on one of the actor's extra threads."""
        raise TypeError(f"{type(self).__name__} serves no peer requests (got {request!r})")

    def backward_on_shard(self, step: int, model: nn.Module) -> tuple[torch.Tensor, int]:
        """Zero the gradients, then forward and backward this rank's part of the step's global
        batch (the data-parallel architectures). Returns (loss, samples)."""
        spec, ctx = self.ctx.spec, self.ctx
        x, y = self.data.shard(step, spec.batch_size, *ctx.data_part)
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(spec.model, model(x.to(ctx.device)), y.to(ctx.device))
        loss.backward()
        return loss.detach(), len(x)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (its shard): model and optimizer, as local tensors."""
        return {
            "model": state.model_state(self.module),
            "optimizer": state.optimizer_state(self.optimizer),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state.load_model_state(self.module, saved["model"])
        state.load_optimizer_state(self.optimizer, saved["optimizer"])

    def state_bytes(self) -> int:
        """Bytes of this rank's training state (model and optimizer, local parts)."""
        total = 0
        for t in _tensors(self.state_dict()):
            total += t.numel() * t.element_size()
        return total

    def metrics(self) -> dict[str, float]:
        """Architecture-specific measurements of this rank, reported with the result."""
        return {}

    def parameters_sample(self, n: int = 256) -> list[float]:
        """The first n values of this rank's flattened parameters (to compare replicas)."""
        out: list[float] = []
        for p in self.module.parameters():
            out += state.local(p).detach().reshape(-1)[: n - len(out)].tolist()
            if len(out) >= n:
                break
        return out

    def audit(self, *, finite: bool, checksum: bool) -> tuple[bool, str | None]:
        """The silent-corruption checks, on this rank's local parameters: whether they are all
        finite (a float sum is NaN or Inf if any element is), and a checksum that any single
        flipped bit changes (the sum of each tensor's 32-bit words, as integers). One pass
        each, no copies: cheap enough to run every few steps."""
        ok, sums = True, []
        with torch.no_grad():
            for p in self.module.parameters():
                t = state.local(p).detach()
                if finite and not bool(torch.isfinite(t.sum())):
                    ok = False
                if checksum:
                    word = torch.int32 if t.element_size() == 4 else torch.uint8
                    words = t.reshape(-1).view(word)
                    sums.append(int(words.sum(dtype=torch.int64)))
        return ok, (",".join(map(str, sums)) if checksum else None)

    def parameters_digest(self) -> str:
        """sha256 of this rank's parameters (its shard), in name order."""
        return tensors_digest(list(self.module.state_dict().items()))


def check_batch_splits(batch_size: int, parts: int, over: str) -> None:
    """Refuse a global batch that does not split evenly, suggesting sizes that do."""
    if batch_size % parts:
        fits = [k * parts for k in range(max(1, batch_size // parts), batch_size // parts + 3)]
        raise SpecError(
            f"batch_size={batch_size} does not split over {over}; use a multiple of {parts}, "
            f"e.g. {', '.join(map(str, fits))}"
        )


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def tensors_digest(named: list[tuple[str, Any]]) -> str:
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(state.local(t).detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class Architecture(ABC):
    """A training architecture. Subclasses set `name`, `summary`, `Params` and `trainer_cls`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams
    trainer_cls: ClassVar[type[Trainer]]

    def __init__(self, spec: ExperimentSpec, params: BaseModel) -> None:
        self.spec = spec
        self.params = params

    @abstractmethod
    def check(self) -> None:
        """Raise SpecError if the spec's shape does not fit, saying which numbers would."""

    @abstractmethod
    def layout(self) -> StateLayout: ...

    # True when every collective of a step runs through the worker's AbortHandle, so the
    # `abort` quiesce can pull survivors out of a dead collective and keep their state. Torch's
    # own FSDP, DTensor and pipelining collectives block inside gloo: survivors are killed.
    abortable: bool = False
    # True when every rank trains its own full replica (gossip): the result reports how far
    # apart they ended. Sharded layouts also have one holder per shard, but nothing to compare.
    independent_replicas: ClassVar[bool] = False
    # Modules the first trainer build of a process imports on its own: DDP, FSDP2, DTensor,
    # pipelining and the parameter server's optimizer all pull in torch's compiler stack
    # (`torch._dynamo`, about 0.8 s on a 2-core machine). A process preloads them as it starts
    # where the spec asks for the fast re-formation (`ExperimentSpec.reform`).
    preload: ClassVar[tuple[str, ...]] = ("torch._dynamo",)

    def continues_without_dead(self) -> bool:
        """True when training goes on without a dead rank (no barrier, no rollback): recovery
        drops it from the group instead of replacing it."""
        return False

    def exact_replay(self) -> bool:
        """True if replaying a step from the same state gives bit-identical results."""
        return True

    def commits_whole_batch(self) -> bool:
        """True when a step that any rank completed trained every rank's share of its global
        batch (the update waited for all of them): then a rank that died after contributing,
        before it recorded the step, still trained its share."""
        return True

    def trainer(self, ctx: WorkerContext) -> Trainer:
        return self.trainer_cls(ctx)
