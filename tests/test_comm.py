"""The DDP all-reduce hook and the abort handle, on a real one-process gloo group: a step whose
all-reduce was not launched (the driver aborted during the backward) is never applied."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from failbench_ray.comm import AbortHandle, CanonicalAllReduceHook, CollectiveAborted


@pytest.fixture
def group() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _ddp(handle: AbortHandle, group: dist.ProcessGroup) -> DistributedDataParallel:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2), process_group=group, init_sync=False)
    hook = CanonicalAllReduceHook(handle, group, list(model.module.parameters()))
    model.register_comm_hook(None, hook.all_reduce)
    return model


def test_a_step_whose_all_reduce_ran_is_applied(group: dist.ProcessGroup) -> None:
    handle = AbortHandle()
    handle.begin_step()
    _ddp(handle, group)(torch.ones(3, 4)).sum().backward()
    handle.check()  # nothing failed: the update may be applied


def test_an_abort_during_the_backward_fails_the_step(group: dist.ProcessGroup) -> None:
    handle = AbortHandle()
    model = _ddp(handle, group)
    handle.begin_step()
    loss = model(torch.ones(3, 4)).sum()
    handle.abort()  # lands before the bucket is ready: the hook launches no all-reduce
    loss.backward()
    with pytest.raises(CollectiveAborted):
        handle.check()  # the gradients are this rank's alone: the step must not be applied
