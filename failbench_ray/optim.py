"""Optimizers from the spec."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from failbench_ray.spec import OptimizerSpec


def build_optimizer(
    spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    if spec.name == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
        )
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
