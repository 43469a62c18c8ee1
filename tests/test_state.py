"""A rank's state (architectures.state): a restore gives the trainer its own tensors."""

from __future__ import annotations

import numpy as np
import torch

from architectures import state
from mechanisms.replication import pack, unpack


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_training_after_a_restore_leaves_the_copy_it_came_from_alone() -> None:
    """`Optimizer.load_state_dict` keeps tensors whose dtype and device fit, and Adam updates
    its moments in place: without a copy, training after a restore rewrote the snapshot (or
    the object-store replica, shared by every rank that restored from it)."""
    model, opt = _trained()
    snap = pack({"model": state.model_state(model), "optimizer": state.optimizer_state(opt)})
    before = snap.buffer.copy()
    for _ in range(2):  # two ranks restoring from the same copy
        m2 = torch.nn.Linear(4, 4)
        o2 = torch.optim.Adam(m2.parameters(), lr=0.1)
        saved = unpack(snap)
        state.load_model_state(m2, saved["model"])
        state.load_optimizer_state(o2, saved["optimizer"])
        m2(torch.randn(2, 4)).sum().backward()
        o2.step()
    assert np.array_equal(snap.buffer, before)


def test_a_restore_from_a_read_only_buffer_trains() -> None:
    """Object-store copies arrive as read-only buffers; the restored optimizer still steps."""
    model, opt = _trained()
    snap = pack({"model": state.model_state(model), "optimizer": state.optimizer_state(opt)})
    snap.buffer.flags.writeable = False
    m2 = torch.nn.Linear(4, 4)
    o2 = torch.optim.Adam(m2.parameters(), lr=0.1)
    saved = unpack(snap)
    state.load_model_state(m2, saved["model"])
    state.load_optimizer_state(o2, saved["optimizer"])
    m2(torch.randn(2, 4)).sum().backward()
    o2.step()
    moments = o2.state_dict()["state"][0]["exp_avg"]
    assert not np.shares_memory(moments.numpy(), snap.buffer)
