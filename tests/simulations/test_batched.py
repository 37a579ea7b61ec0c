"""The batched engine core (simulations.batched) against training the clients one by one.

``train_batched`` must give each client the deltas and train loss that ``Task.train`` gives it alone (build the
model, load the global weights, train with the client's generator), within float tolerance, and leave each
generator where the loop leaves it (codecs draw from it next).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from clients import Dataset, Task, TaskSpec, TrainSettings
from clients.tasks import get_task
from simulations.batched import batched_supported, train_batched

ATOL, RTOL = 1e-5, 1e-4
NUM_PARTS = 40  # Dirichlet(0.5) shares of digits' 1,437 examples: 2 to ~150 each


@pytest.fixture(scope="module")
def digits() -> Task:
    return get_task(TaskSpec())  # the built-in MLP 64-128-10


def one_by_one(task: Task, flat: torch.Tensor, datasets: list[Dataset], cfg: TrainSettings,
               seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Generator]]:
    """The reference: each client alone, as the ClientApp's local_update trains it."""
    deltas, losses, gens = [], [], []
    for data, seed in zip(datasets, seeds, strict=True):
        model = task.build()
        task.layout().load(model, flat)
        task.layout().load_local(model, {}, start=task.initial_local(0))  # (kept and frozen entries: a first round)
        gen = torch.Generator().manual_seed(seed)
        losses.append(task.train(model, data, cfg, gen)["train-loss"])
        deltas.append(task.layout().flatten(model) - flat)
        gens.append(gen)
    return torch.stack(deltas), torch.tensor(losses, dtype=torch.float64), gens


def assert_equivalent(task: Task, datasets: list[Dataset], cfg: TrainSettings, chunk: int = 512) -> torch.Tensor:
    """train_batched equals one_by_one (deltas, losses, generators' end state); returns the deltas."""
    flat = task.init_weights(0)
    seeds = [hash((0, 1, k)) & 0x7FFFFFFF for k in range(len(datasets))]  # as local_update seeds them
    want, want_loss, want_gens = one_by_one(task, flat, datasets, cfg, seeds)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    got, got_loss = train_batched(task, flat, datasets, cfg, gens, chunk=chunk)
    assert got.shape == (len(datasets), task.layout().numel) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got_loss, want_loss, atol=ATOL, rtol=RTOL)
    assert all(torch.equal(g.get_state(), w.get_state()) for g, w in zip(gens, want_gens, strict=True))
    assert got.abs().max() > 1e-3  # the clients trained
    return got


def parts(task: Task, ids: list[int]) -> list[Dataset]:
    return [task.partition(k, NUM_PARTS) for k in ids]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_digits_momentum_and_fedprox(digits: Task, momentum: float, mu: float) -> None:
    data = parts(digits, [0, 1, 2, 3, 4])
    assert len({len(d) for d in data}) > 1  # unequal sizes: padded last batches and early-ending clients
    assert_equivalent(digits, data, TrainSettings(local_epochs=2, batch_size=16, lr=0.1, momentum=momentum,
                                                  proximal_mu=mu))


@settings(max_examples=12)
@given(ids=st.lists(st.integers(0, NUM_PARTS - 1), min_size=1, max_size=5, unique=True),
       epochs=st.integers(1, 3), batch=st.integers(1, 40), momentum=st.sampled_from([0.0, 0.5, 0.9]),
       mu=st.sampled_from([0.0, 0.01, 1.0]), chunk=st.integers(1, 5))
def test_digits_any_sizes(digits: Task, ids: list[int], epochs: int, batch: int, momentum: float, mu: float,
                          chunk: int) -> None:
    cfg = TrainSettings(local_epochs=epochs, batch_size=batch, lr=0.05, momentum=momentum, proximal_mu=mu)
    assert_equivalent(digits, parts(digits, ids), cfg, chunk=chunk)


def test_chunking_changes_nothing(digits: Task) -> None:
    data = parts(digits, [5, 6, 7, 8, 9, 10, 11])
    cfg = TrainSettings(local_epochs=2, batch_size=13, momentum=0.9, proximal_mu=0.1)
    flat = digits.init_weights(3)
    runs = [train_batched(digits, flat, data, cfg, [torch.Generator().manual_seed(k) for k in range(7)], chunk=c)
            for c in (1, 3, 512)]
    for deltas, losses in runs[:-1]:
        torch.testing.assert_close(deltas, runs[-1][0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(losses, runs[-1][1], atol=ATOL, rtol=RTOL)


def test_an_empty_client_takes_no_step(digits: Task) -> None:
    # (Task.train itself reports a NaN loss for no data: torch.split of an empty permutation gives one empty
    # batch; check_data refuses such a client before it trains)
    data, flat, cfg = parts(digits, [0, 1]), digits.init_weights(0), TrainSettings(local_epochs=1, batch_size=8)
    empty = Dataset(data[0].x[:0], data[0].y[:0])
    deltas, losses = train_batched(digits, flat, [data[0], empty, data[1]], cfg, [torch.Generator() for _ in range(3)])
    alone, alone_losses = train_batched(digits, flat, data, cfg, [torch.Generator() for _ in range(2)])
    assert not deltas[1].any() and losses[1] == 0
    torch.testing.assert_close(deltas[[0, 2]], alone, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(losses[[0, 2]], alone_losses, atol=ATOL, rtol=RTOL)


class Regression(Task):
    """A user task: its own MSE loss on float targets, a tied weight and a frozen bias."""

    y_dtype = "float32"

    def build_model(self) -> nn.Module:
        a, b, c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        b.weight = a.weight
        c.bias.requires_grad_(False)
        return nn.Sequential(a, nn.Tanh(), b, nn.GELU(), c)

    def load_data(self) -> tuple[Dataset, Dataset]:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(90, 6)).astype(np.float32)
        return Dataset(x, np.stack([x.sum(1), x[:, 0] * x[:, 1]], 1).astype(np.float32)), Dataset(x[:10], x[:10, :2])

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output - target).pow(2).mean()


class FederatedFrozenRegression(Regression):
    federate_frozen = True


@pytest.mark.parametrize("cls", [Regression, FederatedFrozenRegression])
def test_user_loss_tied_and_frozen_parameters(cls) -> None:
    task = cls()
    train = task.train_set
    data = [Dataset(train.x[s:s + n], train.y[s:s + n]) for s, n in ((0, 23), (23, 5), (28, 40))]
    deltas = assert_equivalent(task, data, TrainSettings(local_epochs=3, batch_size=6, lr=0.05, momentum=0.9,
                                                         proximal_mu=0.1))
    if not cls.federate_frozen:  # off the wire: the frozen bias is no entry of the flat update
        assert task.layout().fixed == ("4.bias",) and "4.bias" not in task.layout().names
        return
    frozen = task.layout().entries[task.layout().names.index("4.bias")]
    assert not deltas[:, frozen.offset:frozen.offset + frozen.numel].any()


class SparseRecommender(Task):
    """Matrix factorisation with sparse embedding gradients (``nn.Embedding(sparse=True)``): ratings by MSE."""

    x_dtype, y_dtype, num_classes = "int64", "float32", None

    def build_model(self) -> nn.Module:
        return _Factorisation(sparse=True)

    def load_data(self) -> tuple[Dataset, Dataset]:
        rng = np.random.default_rng(0)
        x = np.stack([rng.integers(0, 30, 120), rng.integers(0, 20, 120)], 1)
        y = (np.sin(x[:, 0]) * np.cos(x[:, 1]) + 0.1 * rng.normal(size=120)).astype(np.float32)
        return Dataset(x[:100], y[:100]), Dataset(x[100:], y[100:])

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)


class _Factorisation(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.users, self.items = nn.Embedding(30, 4, sparse=sparse), nn.Embedding(20, 4, sparse=sparse)
        self.bias = nn.EmbeddingBag(20, 1, mode="sum", sparse=sparse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.users(x[:, 0]) * self.items(x[:, 1])).sum(1) + self.bias(x[:, 1:])[:, 0]


@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_sparse_embedding_gradients_train_batched_as_one_by_one(mu: float) -> None:
    """vmap's autograd has no sparse tensors: the batched engine runs the embeddings dense, which must give what
    the loop's SGD (momentum and FedProx's term included) gives with sparse gradients."""
    task = SparseRecommender()
    train = task.train_set
    data = [Dataset(train.x[s:s + n], train.y[s:s + n]) for s, n in ((0, 37), (37, 9), (46, 54))]
    assert_equivalent(task, data, TrainSettings(local_epochs=2, batch_size=8, lr=0.1, momentum=0.9, proximal_mu=mu))
    assert all(m.sparse for m in task.build().modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag))


class OwnTrain(Regression):
    def train(self, model, data, settings, generator):
        return {}


class WithBatchNorm(Regression):
    """BatchNorm1d between tied-free layers: running statistics (federated) and the batch count (kept)."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


class ConvBatchNorm(Regression):
    """A CNN with BatchNorm2d on 1x4x4 images, a constant buffer and a buffer counting forwards."""

    def build_model(self) -> nn.Module:
        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                          nn.Linear(64, 2))
                self.register_buffer("scale", torch.tensor(0.5))
                self.register_buffer("calls", torch.zeros(1))

            def forward(self, x):
                self.calls.add_(1)
                return self.body(x.view(-1, 1, 4, 4)[:, :, :, :] * 2 * self.scale)

        return Net()

    def load_data(self) -> tuple[Dataset, Dataset]:
        rng = np.random.default_rng(1)
        x = rng.normal(size=(90, 16)).astype(np.float32)
        return Dataset(x, np.stack([x[:, :8].sum(1), x[:, 0] * x[:, 5]], 1).astype(np.float32)), Dataset(x[:10], x[:10, :2])


class FedBN(WithBatchNorm):
    federate_buffers = False


def uneven(task: Task) -> list[Dataset]:
    """Clients of 23, 5, 40, 11 and 8 examples: with batches of 6, partial last batches of several sizes (never
    one example, which BatchNorm refuses in training), one client with a single batch."""
    train = task.train_set
    return [Dataset(train.x[s:s + n], train.y[s:s + n]) for s, n in ((0, 23), (23, 5), (28, 40), (68, 11), (79, 8))]


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("task", [WithBatchNorm(), ConvBatchNorm()], ids=["bn1d", "conv-bn"])
def test_batchnorm_and_buffers_train_as_each_client_alone(task: Task, momentum: float) -> None:
    """No padding in a batch-statistics model: each client's batches, statistics and counters are its own."""
    cfg = TrainSettings(local_epochs=2, batch_size=6, lr=0.05, momentum=momentum, proximal_mu=0.1)
    deltas = assert_equivalent(task, uneven(task), cfg, chunk=3)
    names = task.layout().names
    mean = task.layout().entries[names.index("1.running_mean" if "1.running_mean" in names
                                             else "body.1.running_mean")]
    assert deltas[:, mean.offset:mean.offset + mean.numel].abs().min(1).values.gt(0).all()  # statistics moved
    assert len({tuple(d[mean.offset:mean.offset + 2].tolist()) for d in deltas}) == 5  # ... each client's own


@pytest.mark.parametrize("task", [WithBatchNorm(), ConvBatchNorm()], ids=["bn1d", "conv-bn"])
def test_a_last_batch_of_one_joins_the_batch_before_it(task: Task) -> None:
    """BatchNorm1d refuses a batch of one in training: with BatchNorm the loop merges an epoch's last batch of one
    into the batch before it (7 examples for batches of 6), and the batched step does the same. Clients of 13, 7,
    25, 12 and 5: three end an epoch on one example; one's only batch is merged (full batches are not a prefix
    of the size order then: clients are sorted by full batches)."""
    from clients.tasks.base import epoch_batches

    assert [len(b) for b in epoch_batches(torch.arange(13), 6, True)] == [6, 7]
    assert [len(b) for b in epoch_batches(torch.arange(13), 6, False)] == [6, 6, 1]
    assert [len(b) for b in epoch_batches(torch.arange(1), 6, True)] == [1]  # (nothing to join: refused as before)
    assert [len(b) for b in epoch_batches(torch.arange(3), 1, True)] == [1, 1, 1]  # (batches of one by request)
    train = task.train_set
    data = [Dataset(train.x[s:s + n], train.y[s:s + n]) for s, n in ((0, 13), (13, 7), (20, 25), (45, 12), (57, 5))]
    cfg = TrainSettings(local_epochs=2, batch_size=6, lr=0.05, momentum=0.9, proximal_mu=0.1)
    assert_equivalent(task, data, cfg, chunk=3)
    if isinstance(task, WithBatchNorm):  # what the merge avoids (BatchNorm2d normalises a 4x4 image's 16 values)
        with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
            task.build().train()(torch.from_numpy(train.x[:1]))


def float64_one_by_one(task: Task, flat: torch.Tensor, datasets: list[Dataset], cfg: TrainSettings,
                       seeds: list[int]) -> torch.Tensor:
    """one_by_one's deltas computed in float64: the reference both float32 paths are measured against."""
    deltas = []
    for data, seed in zip(datasets, seeds, strict=True):
        model = task.build().double()
        task.layout().load(model, flat.double())
        task.train(model, Dataset(data.x.astype(np.float64), data.y.astype(np.float64)), cfg,
                   torch.Generator().manual_seed(seed))
        state = model.state_dict()
        deltas.append(torch.cat([state[e.name].reshape(-1).double() for e in task.layout().entries]) - flat.double())
    return torch.stack(deltas)


@settings(max_examples=10, deadline=None)
@given(sizes=st.lists(st.integers(3, 30), min_size=1, max_size=6), epochs=st.integers(1, 3), batch=st.integers(4, 12),
       momentum=st.sampled_from([0.0, 0.9]), chunk=st.integers(1, 6))
def test_batchnorm_any_sizes(sizes: list[int], epochs: int, batch: int, momentum: float, chunk: int) -> None:
    """Runs of equal batch size for any mix of client sizes, epochs and chunks (a last batch of one joins the one
    before it). No last batch of two (normalising two examples maps them to +-1 whatever they are: training
    turns chaotic, one by one itself ends up 5e-4 to 5e-3 from float64 and the two float32 paths drift apart
    further). BatchNorm with momentum can still make training ill-conditioned (a client's delta reached 33, each
    float32 path ~1e-3 from float64), so each client's batched delta must be as close to the float64 result as
    its one-by-one delta is (within 10x, plus 1e-5); padding misses by 0.1-10."""
    task = WithBatchNorm()
    train, starts = task.train_set, np.cumsum([0, *sizes[:-1]])
    data = [Dataset(train.x[s:s + n], train.y[s:s + n]) for s, n in zip(starts % 60, sizes, strict=True)
            if n % batch != 2]
    if not data:
        return
    cfg = TrainSettings(local_epochs=epochs, batch_size=batch, lr=0.05, momentum=momentum)
    flat, seeds = task.init_weights(0), list(range(len(data)))
    exact = float64_one_by_one(task, flat, data, cfg, seeds)
    alone, _, _ = one_by_one(task, flat, data, cfg, seeds)
    got, _ = train_batched(task, flat, data, cfg, [torch.Generator().manual_seed(s) for s in seeds], chunk=chunk)
    err_alone = (alone.double() - exact).abs().amax(1)
    err_batched = (got.double() - exact).abs().amax(1)
    assert (err_batched <= 10 * err_alone + 1e-5).all(), (err_batched, err_alone)


def assert_kept_equivalent(task: Task, data: list[Dataset], kept: list[dict[str, torch.Tensor]], cfg: TrainSettings,
                           chunk: int = 512, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """train_batched (on ``device``) from each client's ``kept`` entries equals each client alone on the CPU as the
    ClientApp trains it (load_local over ``initial_local``, train, local_state): the deltas and the entries handed
    back; returns those (``kept`` itself is left as given)."""
    flat, seeds = task.init_weights(0), list(range(len(data)))
    want, want_kept = [], []
    for k, (d, s) in enumerate(zip(data, seeds, strict=True)):
        model = task.build()
        task.layout().load(model, flat)
        task.layout().load_local(model, {**task.initial_local(0), **kept[k]})
        task.train(model, d, cfg, torch.Generator().manual_seed(s))
        want.append(task.layout().flatten(model) - flat)
        want_kept.append(task.layout().local_state(model))
    out = [dict(k) for k in kept]
    got, _ = train_batched(task, flat.to(device), data, cfg, [torch.Generator().manual_seed(s) for s in seeds],
                           kept=out, chunk=chunk, seed=0)
    assert got.device.type == device
    tol = {"atol": ATOL, "rtol": RTOL} if device == "cpu" else {"atol": 1e-4, "rtol": 1e-3}  # (TF32 on the GPU)
    torch.testing.assert_close(got.cpu(), torch.stack(want), **tol)
    for k in range(len(data)):
        assert want_kept[k].keys() == set(task.layout().local)
        for name, value in want_kept[k].items():
            torch.testing.assert_close(out[k][name].reshape(value.shape), value, **tol)
    return out


def test_kept_entries_start_from_each_client_and_come_back() -> None:
    """FedBN: each client's statistics start from what it kept and return as its training left them, as the
    ClientApp's load_local / local_state; the federated part equals training alone. (The batch count is not
    kept under momentum 0.1: an entry outside the layout's is left as given.)"""
    task = FedBN()
    data, flat = uneven(task), task.init_weights(0)
    cfg = TrainSettings(local_epochs=2, batch_size=6, lr=0.05, momentum=0.9)
    assert set(task.layout().local) == {"1.running_mean", "1.running_var"}
    kept = [{"1.running_mean": torch.full((8,), float(k)), "1.running_var": torch.full((8,), 1.0 + k),
             "1.num_batches_tracked": torch.tensor(10 * k)} for k in range(len(data))]
    kept[2] = {}  # a client's first round: the built values
    out = assert_kept_equivalent(task, data, kept, cfg)
    assert [int(o["1.num_batches_tracked"]) for o in out[:2]] == [0, 10] and set(out[2]) == set(task.layout().local)
    with pytest.raises(ValueError, match="kept must have one dict per client"):
        train_batched(task, flat, data, cfg, [torch.Generator() for _ in data], kept=[{}])


class PersonalHead(WithBatchNorm):
    keep_local = ("3.*",)  # the output layer stays on each client


def test_a_kept_head_trains_from_each_clients_own_start_under_fedprox() -> None:
    """A trainable kept entry starts from the client's own value, and FedProx pulls it back to that start, not
    to another client's (one anchor row for all had moved the heads 0.01-0.27 away from one by one's)."""
    task = PersonalHead()
    data = uneven(task)
    cfg = TrainSettings(local_epochs=2, batch_size=6, lr=0.05, momentum=0.9, proximal_mu=1.0)
    assert {"3.weight", "3.bias"} <= set(task.layout().local)
    kept = [{"3.weight": torch.full((2, 8), 0.1 * k), "3.bias": torch.full((2,), -0.2 * k)} for k in range(len(data))]
    kept[1] = {}  # a client's first round: the head init_weights(seed)'s model draws, as the ClientApp starts it
    assert_kept_equivalent(task, data, kept, cfg, chunk=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)")
def test_kept_heads_and_statistics_batched_on_cuda() -> None:
    """FedBN's statistics and a personal head under FedProx, batched on the GPU: each client alone's on the CPU
    (the first start, ``initial_local``, is kept on the CPU and moved)."""
    task = PersonalHead()
    data = uneven(task)
    cfg = TrainSettings(local_epochs=2, batch_size=6, lr=0.05, momentum=0.9, proximal_mu=1.0)
    kept = [{"3.weight": torch.full((2, 8), 0.1 * k), "3.bias": torch.full((2,), -0.2 * k)} for k in range(len(data))]
    kept[1] = {}
    assert_kept_equivalent(task, data, kept, cfg, chunk=2, device="cuda")


def test_refusals_say_why(digits: Task) -> None:
    assert batched_supported(digits, digits.build()) is None
    assert batched_supported(WithBatchNorm(), WithBatchNorm().build()) is None
    reason = batched_supported(OwnTrain(), OwnTrain().build())
    assert reason is not None and "own train" in reason and "one at a time" in reason
    cumulative = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=None))
    assert "momentum=None" in batched_supported(Regression(), cumulative)
    stateless = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, track_running_stats=False))
    assert batched_supported(Regression(), stateless) is None
    assert "dropout" in batched_supported(Regression(), nn.Sequential(nn.Linear(6, 2), nn.Dropout(0.1)))
    # an embedding that renormalises its rows as it reads them, or scales its gradient by a batch's counts, trains
    # otherwise batched than one by one (by 0.02-0.4, a review); a sparse max-bag, which torch does not train at all
    for emb, what in ((nn.Embedding(9, 2, max_norm=1.0), "(max_norm)"), (nn.EmbeddingBag(9, 2, max_norm=1.0), "(max_norm)"),
                      (nn.Embedding(9, 2, scale_grad_by_freq=True), "(scale_grad_by_freq)")):
        assert what in batched_supported(SparseRecommender(), nn.Sequential(emb))
    assert "mode='max'" in batched_supported(SparseRecommender(), nn.Sequential(nn.EmbeddingBag(9, 2, mode="max",
                                                                                                 sparse=True)))
    assert batched_supported(SparseRecommender(), nn.Sequential(nn.EmbeddingBag(9, 2, mode="max"))) is None
    task, data = OwnTrain(), [Regression().train_set]
    with pytest.raises(ValueError, match="cannot be trained batched: task OwnTrain brings its own train"):
        train_batched(task, task.init_weights(0), data, TrainSettings(), [torch.Generator()])


def test_bad_inputs(digits: Task) -> None:
    flat, data, g = digits.init_weights(0), parts(digits, [0, 1]), torch.Generator()
    with pytest.raises(ValueError, match="generators must be distinct"):
        train_batched(digits, flat, data, TrainSettings(), [g, g])
    with pytest.raises(ValueError, match="one entry per client"):
        train_batched(digits, flat, data, TrainSettings(), [g])
    with pytest.raises(ValueError, match="global_flat must be the task's 9610 float32"):
        train_batched(digits, flat[:-1], data, TrainSettings(), [g, torch.Generator()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)")
def test_batched_on_cuda_equals_one_by_one_on_cpu(digits: Task) -> None:
    """The batched engine on the GPU: the same deltas, losses and generators as each client alone on the CPU."""
    data = parts(digits, [0, 1, 2, 3, 4, 5])
    cfg = TrainSettings(local_epochs=2, batch_size=16, lr=0.1, momentum=0.9, proximal_mu=0.1)
    flat = digits.init_weights(0)
    seeds = [hash((0, 1, k)) & 0x7FFFFFFF for k in range(len(data))]
    want, want_loss, want_gens = one_by_one(digits, flat, data, cfg, seeds)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    got, got_loss = train_batched(digits, flat.cuda(), data, cfg, gens)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-3)  # (TF32 and other kernels on the GPU)
    torch.testing.assert_close(got_loss.cpu(), want_loss, atol=1e-4, rtol=1e-3)
    assert all(torch.equal(g.get_state(), w.get_state()) for g, w in zip(gens, want_gens, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)")
def test_batchnorm_batched_on_cuda_equals_one_by_one_on_cpu() -> None:
    """A BatchNorm CNN batched on the GPU (no padding, stacked statistics): each client alone's."""
    task = ConvBatchNorm()
    data = uneven(task)
    cfg = TrainSettings(local_epochs=2, batch_size=6, lr=0.05, momentum=0.9)
    flat, seeds = task.init_weights(0), list(range(len(data)))
    want, want_loss, _ = one_by_one(task, flat, data, cfg, seeds)
    got, got_loss = train_batched(task, flat.cuda(), data, cfg, [torch.Generator().manual_seed(s) for s in seeds])
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(got_loss.cpu(), want_loss, atol=1e-4, rtol=1e-3)
