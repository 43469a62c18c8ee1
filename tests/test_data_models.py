"""Synthetic data and models: determinism, sharding, sizes, and that the task is learnable."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from failbench_ray.data import SyntheticData
from failbench_ray.models import build_model, loss_fn, param_count
from failbench_ray.optim import build_optimizer
from failbench_ray.spec import ModelSpec, OptimizerSpec

MLP = ModelSpec(kind="mlp", input_dim=12, hidden_dim=16, depth=2, num_classes=5)
GPT = ModelSpec(kind="transformer", vocab_size=32, d_model=32, n_layers=2, n_heads=4, seq_len=8)


@pytest.mark.parametrize("spec", [MLP, GPT], ids=["mlp", "transformer"])
def test_data_is_a_pure_function_of_seed_and_step(spec: ModelSpec) -> None:
    a, b = SyntheticData(spec, seed=3), SyntheticData(spec, seed=3)
    # interleave calls: no hidden state carries over between steps
    xb7, yb7 = b.global_batch(7, 24)
    xa5, ya5 = a.global_batch(5, 24)
    xa7, ya7 = a.global_batch(7, 24)
    xb5, yb5 = b.global_batch(5, 24)
    assert torch.equal(xa5, xb5) and torch.equal(ya5, yb5)
    assert torch.equal(xa7, xb7) and torch.equal(ya7, yb7)
    assert not torch.equal(xa5, xa7)
    x_other, _ = SyntheticData(spec, seed=4).global_batch(5, 24)
    assert not torch.equal(xa5, x_other)


def test_data_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    SyntheticData(MLP, seed=0).global_batch(1, 8)
    SyntheticData(GPT, seed=0).global_batch(1, 8)
    assert torch.equal(torch.rand(4), expected)


def test_batch_shapes_and_labels() -> None:
    x, y = SyntheticData(MLP, 0).global_batch(1, 24)
    assert x.shape == (24, MLP.input_dim) and x.dtype == torch.float32
    assert y.shape == (24,) and y.dtype == torch.long
    assert int(y.min()) >= 0 and int(y.max()) < MLP.num_classes

    x, y = SyntheticData(GPT, 0).global_batch(1, 24)
    assert x.shape == y.shape == (24, GPT.seq_len) and x.dtype == torch.long
    assert int(x.min()) >= 0 and int(x.max()) < GPT.vocab_size
    assert torch.equal(y[:, :-1], x[:, 1:])  # targets are the next tokens


@pytest.mark.parametrize("spec", [MLP, GPT], ids=["mlp", "transformer"])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 8])
def test_shards_concatenate_to_the_global_batch(spec: ModelSpec, count: int) -> None:
    data = SyntheticData(spec, seed=11)
    batch = 24
    x, y = data.global_batch(9, batch)
    parts = [data.shard(9, batch, i, count) for i in range(count)]
    assert all(len(px) == batch // count for px, _ in parts)
    assert torch.equal(torch.cat([px for px, _ in parts]), x)
    assert torch.equal(torch.cat([py for _, py in parts]), y)


@pytest.mark.parametrize("spec", [MLP, GPT], ids=["mlp", "transformer"])
def test_build_model_is_deterministic_per_seed(spec: ModelSpec) -> None:
    a = build_model(spec, seed=5).state_dict()
    b = build_model(spec, seed=5).state_dict()
    c = build_model(spec, seed=6).state_dict()
    assert a.keys() == b.keys() == c.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert any(not torch.equal(a[name], c[name]) for name in a)


def test_build_model_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(1)
    expected = torch.rand(4)
    torch.manual_seed(1)
    build_model(GPT, seed=99)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec(),
        ModelSpec(kind="mlp", input_dim=3, hidden_dim=5, depth=1, num_classes=2),
        ModelSpec(kind="mlp", input_dim=64, hidden_dim=17, depth=3, num_classes=10),
        ModelSpec(kind="transformer"),
        ModelSpec(kind="transformer", vocab_size=50, d_model=32, n_layers=3, n_heads=8, seq_len=9),
        ModelSpec(kind="transformer", vocab_size=7, d_model=12, n_layers=1, n_heads=3, seq_len=2),
    ],
    ids=lambda s: f"{s.kind}",
)
def test_param_count_matches_the_built_model(spec: ModelSpec) -> None:
    model = build_model(spec, seed=0)
    assert param_count(spec) == sum(p.numel() for p in model.parameters())


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread, as in a worker (threads_per_worker=1): on a busy machine, two
    threads that spin-wait for each other make these loops several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
def test_transformer_learns_the_synthetic_task() -> None:
    model = build_model(GPT, seed=0)
    data = SyntheticData(GPT, seed=0)
    opt = build_optimizer(OptimizerSpec(name="adam", lr=3e-3), model.parameters())
    losses = []
    for step in range(1, 31):
        x, y = data.global_batch(step, 32)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(GPT, model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = losses[0], sum(losses[-5:]) / 5
    assert first == pytest.approx(torch.log(torch.tensor(32.0)).item(), rel=0.25)  # ~uniform
    assert last < 0.6 * first, losses


@pytest.mark.usefixtures("one_thread")
def test_mlp_learns_the_synthetic_task() -> None:
    model = build_model(MLP, seed=0)
    data = SyntheticData(MLP, seed=0)
    opt = build_optimizer(OptimizerSpec(name="sgd", lr=0.1, momentum=0.9), model.parameters())
    losses = []
    for step in range(1, 61):
        x, y = data.global_batch(step, 64)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(MLP, model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
