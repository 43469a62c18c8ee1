"""A rank's state (architectures.state): a restore gives the trainer its own tensors."""

from __future__ import annotations

import numpy as np
import torch

from architectures import state
from failbench_ray.replication import Packed, pack, unpack


def _snapshot() -> Packed:
    """A model's and its Adam's state after one step, packed as a snapshot or replica is."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return pack({"model": state.model_state(model), "optimizer": state.optimizer_state(opt)})


def _restore_and_step(snap: Packed) -> torch.optim.Optimizer:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    saved = unpack(snap)
    state.load_model_state(model, saved["model"])
    state.load_optimizer_state(opt, saved["optimizer"])
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return opt


def test_training_after_a_restore_leaves_the_copy_it_came_from_alone() -> None:
    """`Optimizer.load_state_dict` keeps tensors whose dtype and device fit, and Adam updates
    its moments in place: without a copy, training after a restore rewrote the snapshot (or
    the object-store replica, shared by every rank that restored from it)."""
    snap = _snapshot()
    before = snap.buffer.copy()
    for _ in range(2):  # two ranks restoring from the same copy
        _restore_and_step(snap)
    assert np.array_equal(snap.buffer, before)


def test_a_restore_from_a_read_only_buffer_trains() -> None:
    """Object-store copies arrive as read-only buffers; the restored optimizer still steps."""
    snap = _snapshot()
    snap.buffer.flags.writeable = False
    opt = _restore_and_step(snap)
    moments = opt.state_dict()["state"][0]["exp_avg"]
    assert not np.shares_memory(moments.numpy(), snap.buffer)
