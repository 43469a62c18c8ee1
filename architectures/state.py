"""One rank's training state as plain local tensors, whatever the parallelism.

FSDP2 and tensor parallelism keep parameters and optimizer state as DTensors. A checkpoint holds
each rank's local part; loading rebuilds DTensors with the live parameter's mesh and placements.
For plain tensors (DDP, pipeline stages) everything here is the identity.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor  # noqa: F401  (a type only; see _is_dtensor)


def _is_dtensor(t: Any) -> TypeGuard[DTensor]:
    # Without importing DTensor (most of a second of CPU in every worker): a value can only be
    # one if the module that defines it is loaded (FSDP2 and tensor parallelism load it).
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local(t: Any) -> Any:
    """The local part of a DTensor (recursively through dicts and lists); other values as is."""
    if _is_dtensor(t):
        return t.to_local()
    if isinstance(t, dict):
        return {k: local(v) for k, v in t.items()}
    if isinstance(t, list | tuple):
        return type(t)(local(v) for v in t)
    return t


def model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: local(v).detach().clone() for k, v in module.state_dict().items()}


def load_model_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    live = module.state_dict()
    missing = set(live) ^ set(state)
    if missing:
        raise KeyError(f"checkpoint and model disagree on {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, value in live.items():
            local(value).copy_(state[name])


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    sd: dict[str, Any] = optimizer.state_dict()
    return {"state": local(sd["state"]), "param_groups": sd["param_groups"]}


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rebuilt: dict[int, dict[str, Any]] = {}
    for idx, entries in state["state"].items():
        p = params[int(idx)]
        rebuilt[int(idx)] = {k: _like(p, v) for k, v in entries.items()}
    optimizer.load_state_dict({"state": rebuilt, "param_groups": state["param_groups"]})


def _like(param: torch.Tensor, value: Any) -> Any:
    """A saved local tensor as the optimizer's own copy, a DTensor shaped like `param` where
    `param` is one. Always a copy: `Optimizer.load_state_dict` keeps the tensors it is given
    when dtype and device fit, and Adam then updates them in place, which would rewrite the
    snapshot or the replica they came from (one object-store copy shared by every rank that
    restored from it, so two replacements would each apply every update to the same moments)."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.clone()
    if _is_dtensor(param):
        from torch.distributed.tensor import DTensor  # loaded already: param is one

        if value.shape != param.to_local().shape:
            return value
        return DTensor.from_local(
            value,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return value
