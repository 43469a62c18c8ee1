"""Synthetic, deterministic data.

The global batch of step s is a pure function of (seed, step); a rank's part is a fixed slice of
it. So a replayed step sees exactly the same samples, and a single process that trains on the
whole global batch sees what all data-parallel ranks see together.
"""

from __future__ import annotations

import torch

from failbench_ray.spec import ModelSpec

_STEP_STRIDE = 1_000_003  # keeps (seed, step) streams apart


class SyntheticData:
    """A learnable synthetic task: a fixed random teacher labels random inputs."""

    def __init__(self, spec: ModelSpec, seed: int) -> None:
        self.spec = spec
        self.seed = seed
        g = torch.Generator().manual_seed(seed + 7)
        if spec.kind == "mlp":
            self._teacher = torch.randn(spec.input_dim, spec.num_classes, generator=g)
        else:
            # next token = (a * token + b) mod V: a simple pattern a transformer learns quickly.
            self._a = int(torch.randint(1, spec.vocab_size, (1,), generator=g))
            self._b = int(torch.randint(0, spec.vocab_size, (1,), generator=g))

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * _STEP_STRIDE + step)
        s = self.spec
        if s.kind == "mlp":
            x = torch.randn(batch_size, s.input_dim, generator=g)
            return x, (x @ self._teacher).argmax(dim=1)
        tokens = torch.empty(batch_size, s.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, s.vocab_size, (batch_size,), generator=g)
        for i in range(1, s.seq_len + 1):
            tokens[:, i] = (self._a * tokens[:, i - 1] + self._b) % s.vocab_size
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def shard(
        self, step: int, batch_size: int, index: int, count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Part `index` of `count` contiguous parts of the global batch of `step` (equal when
        `count` divides the batch; else the sizes differ by at most one sample)."""
        x, y = self.global_batch(step, batch_size)
        lo, hi = index * batch_size // count, (index + 1) * batch_size // count
        return x[lo:hi], y[lo:hi]
