"""Tasks: fixed held-out splits, seeded init, partitions, and client data checks."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

import clients.tasks.synthetic as synthetic_mod
from clients import ClientError, Dataset, Task, TaskSpec, get_task
from clients.tasks import DigitsTask, SyntheticTask
from clients.tasks.synthetic import CLASSES, DIM, NUM_SOURCES, PER_SOURCE, synthetic

TASKS = {"digits": DigitsTask, "synthetic": SyntheticTask}
TOTAL = {"digits": 1797, "synthetic": NUM_SOURCES * PER_SOURCE}
DIMS = {"digits": (64, 10), "synthetic": (DIM, CLASSES)}


def _full(name: str, seed: int = 0) -> Dataset:
    if name == "digits":
        from sklearn.datasets import load_digits

        raw = load_digits()
        return Dataset((raw.data / 16.0).astype(np.float32), raw.target.astype(np.int64))
    x, y = synthetic(1.0, 1.0, seed)
    return Dataset(x, y)


def _rows(d: Dataset) -> Counter:
    return Counter(xr.tobytes() + int(yr).to_bytes(8, "little") for xr, yr in zip(d.x, d.y, strict=True))


@pytest.fixture(scope="module", params=list(TASKS))
def name(request):
    return request.param


@pytest.fixture(scope="module")
def task(name):
    return TASKS[name](TaskSpec(task=name))


def test_dimensions_and_dtypes(task, name):
    assert (task.input_dim, task.num_classes) == DIMS[name]
    for d in (task.train_set, task.test_set):
        assert d.x.dtype == np.float32 and d.y.dtype == np.int64
        assert d.x.shape == (len(d), task.input_dim)
        assert d.y.min() >= 0 and d.y.max() < task.num_classes


def test_train_and_test_are_a_disjoint_split_of_all_data(task, name):
    train, test = task.train_set, task.test_set
    assert len(train) + len(test) == TOTAL[name]
    assert len(test) == pytest.approx(0.2 * TOTAL[name], abs=1)
    # as multisets of (x, y) rows, train + test is exactly the full data set
    assert _rows(train) + _rows(test) == _rows(_full(name))


def test_test_split_is_fixed_by_data_seed(name):
    a = TASKS[name](TaskSpec(task=name, data_seed=5))
    b = TASKS[name](TaskSpec(task=name, data_seed=5))
    c = TASKS[name](TaskSpec(task=name, data_seed=6))
    assert np.array_equal(a.test_set.x, b.test_set.x) and np.array_equal(a.test_set.y, b.test_set.y)
    assert np.array_equal(a.train_set.x, b.train_set.x)
    assert not np.array_equal(a.test_set.x, c.test_set.x)


def test_digits_split_is_stratified():
    t = DigitsTask(TaskSpec())
    share = np.bincount(t.test_set.y, minlength=10) / np.bincount(_full("digits").y, minlength=10)
    assert np.all(np.abs(share - 0.2) < 0.02)


def test_digits_are_sklearns_own_read_without_importing_sklearn():
    from sklearn.datasets import load_digits

    from clients.tasks.digits import digits_arrays

    pixels, labels = digits_arrays()
    raw = load_digits()
    assert np.array_equal(pixels, raw.data) and np.array_equal(labels, raw.target)


@pytest.mark.parametrize("counts", [[178, 182, 177, 183, 181, 182, 181, 179, 174, 180],  # digits' own
                                    [2, 2, 2, 3, 50], [7, 7, 7, 7], [400, 3, 11]])  # ties, tiny and lopsided classes
def test_the_stratified_split_takes_sklearns_very_indices(counts):
    from sklearn.model_selection import train_test_split

    from clients.tasks.digits import stratified_split

    y = np.random.default_rng(len(counts)).permutation(np.repeat(np.arange(len(counts)), counts))
    x = np.arange(len(y), dtype=np.float64)[:, None]
    for seed in (0, 1, 7, 2**31):
        train, test = stratified_split(x, y, seed)
        xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
        assert np.array_equal(train.x, xtr) and np.array_equal(test.x, xte)
        assert np.array_equal(train.y, ytr) and np.array_equal(test.y, yte)


def test_the_builtin_tasks_load_their_data_without_sklearn():
    import subprocess
    import sys

    code = ("import sys; from clients.tasks import DigitsTask, SyntheticTask; from clients import TaskSpec\n"
            "DigitsTask(TaskSpec()).train_set; SyntheticTask(TaskSpec(task='synthetic')).train_set\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'sklearn', 'scipy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_synthetic_falls_back_to_plain_split_when_a_class_is_a_singleton(monkeypatch):
    x = np.arange(100 * DIM, dtype=np.float32).reshape(100, DIM)
    y = np.zeros(100, np.int64)
    y[0] = 3  # one sample of class 3: stratification is impossible
    monkeypatch.setattr(synthetic_mod, "synthetic", lambda a, b, s: (x, y))
    t1, t2 = SyntheticTask(TaskSpec(task="synthetic")), SyntheticTask(TaskSpec(task="synthetic"))
    assert (len(t1.train_set), len(t1.test_set)) == (80, 20)
    assert np.array_equal(t1.test_set.x, t2.test_set.x)
    assert _rows(t1.train_set) + _rows(t1.test_set) == _rows(Dataset(x, y))


def test_synthetic_data_depends_on_alpha_beta():
    x1, _ = synthetic(1.0, 1.0, 0)
    x2, _ = synthetic(0.0, 0.0, 0)
    assert x1.shape == x2.shape == (NUM_SOURCES * PER_SOURCE, DIM)
    assert not np.array_equal(x1, x2)


def test_init_weights_deterministic_by_seed_and_sized_like_the_model(task):
    w1, w2, w3 = task.init_weights(1), task.init_weights(1), task.init_weights(2)
    n = sum(p.numel() for p in task.build_model().parameters())
    assert w1.shape == (n,) and w1.dtype == torch.float32
    assert torch.equal(w1, w2)
    assert not torch.equal(w1, w3)
    assert torch.isfinite(w1).all()


def test_init_weights_param_counts():
    assert DigitsTask(TaskSpec()).init_weights(0).numel() == 64 * 128 + 128 + 128 * 10 + 10
    assert SyntheticTask(TaskSpec(task="synthetic")).init_weights(0).numel() == DIM * CLASSES + CLASSES


def test_init_weights_does_not_disturb_global_rng(task):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    task.init_weights(7)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("partitioning", ["iid", "dirichlet"])
def test_partitions_cover_the_train_set_and_are_deterministic(name, partitioning):
    spec = TaskSpec(task=name, partitioning=partitioning)
    a, b = TASKS[name](spec), TASKS[name](spec)
    parts = [a.partition(i, 5) for i in range(5)]
    assert sum(len(p) for p in parts) == len(a.train_set)
    merged = Counter()
    for p in parts:
        merged += _rows(p)
    assert merged == _rows(a.train_set)
    for i in range(5):
        assert np.array_equal(parts[i].x, b.partition(i, 5).x)
        assert np.array_equal(parts[i].y, b.partition(i, 5).y)


@pytest.mark.parametrize("pid", [-1, 5, 100])
def test_partition_id_out_of_range(task, pid):
    with pytest.raises(ClientError, match=r"partition-id must be in \[0, 5\)\. Found"):
        task.partition(pid, 5)


def test_get_task_is_cached_per_spec():
    spec = TaskSpec(data_seed=11)
    assert get_task(spec) is get_task(TaskSpec(data_seed=11))
    assert isinstance(get_task(spec), DigitsTask)
    assert isinstance(get_task(TaskSpec(task="synthetic", data_seed=11)), SyntheticTask)


# --------------------------------------------------------------------------- check_data


def _good(task, n=6) -> Dataset:
    return Dataset(np.zeros((n, task.input_dim), np.float64), np.arange(n) % task.num_classes)


def test_check_data_accepts_and_casts(task):
    out = task.check_data(_good(task), "mine.npz")
    assert out.x.dtype == np.float32 and out.y.dtype == np.int64
    assert len(out) == 6


def _bad_cases(task):
    d = task.input_dim
    nan_x = np.zeros((4, d), np.float32)
    nan_x[2, 3] = np.nan
    inf_x = np.zeros((4, d), np.float32)
    inf_x[0, 0] = np.inf
    y4 = np.zeros(4, np.int64)
    return {
        "feature dim": (Dataset(np.zeros((4, d + 1), np.float32), y4), rf"x must have shape \(n, {d}\)"),
        "1-D x": (Dataset(np.zeros(4 * d, np.float32), y4), r"x must have shape"),
        "3-D x": (Dataset(np.zeros((4, d, 1), np.float32), y4), r"x must have shape"),
        "lengths differ": (Dataset(np.zeros((4, d), np.float32), np.zeros(3, np.int64)), r"y must have shape \(4,\)"),
        "2-D y": (Dataset(np.zeros((4, d), np.float32), np.zeros((4, 1), np.int64)), r"y must have shape \(4,\)"),
        "empty": (Dataset(np.zeros((0, d), np.float32), np.zeros(0, np.int64)), r"n > 0"),
        "label too big": (Dataset(np.zeros((4, d), np.float32), np.array([0, 1, task.num_classes, 2])),
                          rf"integer labels in \[0, {task.num_classes}\)"),
        "negative label": (Dataset(np.zeros((4, d), np.float32), np.array([0, -1, 1, 2])), r"integer labels"),
        "float labels": (Dataset(np.zeros((4, d), np.float32), np.array([0.0, 1.0, 1.0, 2.0])), r"integer labels"),
        "NaN": (Dataset(nan_x, y4), r"x must be finite"),
        "inf": (Dataset(inf_x, y4), r"x must be finite"),
    }


@pytest.mark.parametrize("case", ["feature dim", "1-D x", "3-D x", "lengths differ", "2-D y", "empty",
                                  "label too big", "negative label", "float labels", "NaN", "inf"])
def test_check_data_rejects(task, case):
    data, rule = _bad_cases(task)[case]
    with pytest.raises(ClientError, match=rule) as info:
        task.check_data(data, "node-7.npz")
    assert str(info.value).startswith("node-7.npz: ")


@pytest.mark.parametrize("which", ["string labels", "string features"])
def test_check_data_rejects_non_numeric_arrays(task, which):
    d = task.input_dim
    if which == "string labels":
        data = Dataset(np.zeros((2, d), np.float32), np.array(["a", "b"]))
    else:
        data = Dataset(np.full((2, d), "a"), np.array([0, 1]))
    with pytest.raises(ClientError):
        task.check_data(data, "node.npz")


# --- the default loops' memory format (Task.channels_last) ---------------------------------------------

class _ImageTask(Task):
    """A BatchNorm CNN on 3x8x8 images; ``view`` picks a forward that ``.view``s its conv output."""

    view = False

    def build_model(self):
        view = self.view

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
                self.bn = torch.nn.BatchNorm2d(8)
                self.fc = torch.nn.Linear(8 * 8 * 8, 4)

            def forward(self, x):
                h = torch.relu(self.bn(self.conv(x)))
                return self.fc(h.view(len(h), -1) if view else h.flatten(1))

        return Net()

    def load_data(self):
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(96, 3, 8, 8)).astype(np.float32), rng.integers(0, 4, 96)
        return Dataset(x[:64], y[:64]), Dataset(x[64:], y[64:])


def _trained(task, seed=0):
    from clients import TrainSettings

    torch.manual_seed(seed)
    model = task.build()
    stats = task.train(model, task.train_set, TrainSettings(local_epochs=2, batch_size=16, lr=0.1, momentum=0.9),
                       torch.Generator().manual_seed(seed))
    return model, stats


def test_channels_last_trains_and_evaluates_as_the_default_format_and_leaves_the_model_as_built():
    auto, fixed = _ImageTask(), type("Nchw", (_ImageTask,), {"channels_last": False})()
    (m_auto, s_auto), (m_fixed, s_fixed) = _trained(auto), _trained(fixed)
    assert auto._channels_last_verdicts and all(auto._channels_last_verdicts.values())  # auto chose it
    for (name, a), (_, b) in zip(m_auto.state_dict().items(), m_fixed.state_dict().items(), strict=True):
        assert a.is_contiguous(), name  # back in the default format: layouts, records and numpy see no strides
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    assert s_auto["train-loss"] == pytest.approx(s_fixed["train-loss"], rel=1e-5)
    assert not torch.equal(m_auto.conv.weight, auto.build().conv.weight)  # it trained
    ev_auto, ev_fixed = auto.evaluate(m_auto, auto.test_set), fixed.evaluate(m_fixed, fixed.test_set)
    assert ev_auto == pytest.approx(ev_fixed, rel=1e-4)


def test_a_forward_that_views_a_channels_last_activation_keeps_the_default_format():
    task = type("Viewing", (_ImageTask,), {"view": True})()
    model = task.build()
    with pytest.raises(RuntimeError, match="view"):  # what auto must avoid
        model.to(memory_format=torch.channels_last)(torch.zeros(2, 3, 8, 8))
    model.to(memory_format=torch.contiguous_format)
    model, stats = _trained(task)
    assert list(task._channels_last_verdicts.values()) == [False] and np.isfinite(stats["train-loss"])
    reference, _ = _trained(type("Nchw", (_ImageTask,), {"view": True, "channels_last": False})())
    for a, b in zip(model.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the very same arithmetic as without the feature


def test_the_probe_changes_no_state_and_models_without_2d_convolutions_are_not_probed():
    task = _ImageTask()
    model = task.build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    task.evaluate(model, task.test_set)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # eval mode, no grad: BatchNorm's statistics untouched
    mlp = DigitsTask()
    mlp.evaluate(mlp.build(), mlp.test_set)
    assert list(mlp._channels_last_verdicts.values()) == [False]


def test_a_working_model_is_reused_and_a_nodes_first_round_starts_from_initial_local():
    from flwr.app import Context, RecordDict

    from clients import TrainSettings
    from clients.client_app import global_model_from

    task = type("FedBN", (_ImageTask,), {"federate_buffers": False})()
    layout = task.layout()
    assert set(layout.local) == {"bn.running_mean", "bn.running_var"}  # (the batch count: unused)
    first = task.working_model(torch.device("cpu"))
    task.train(first, task.train_set, TrainSettings(local_epochs=1, batch_size=16, lr=0.1), torch.Generator())
    assert first.conv.weight.grad is not None
    fresh = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    again = global_model_from(task, layout, task.init_weights(3), fresh, private=False, seed=3)
    assert again is first and again.conv.weight.grad is None
    for name, value in task.initial_local(3).items():  # the last node's statistics are not a new node's
        assert torch.equal(again.state_dict()[name], value), name
    from clients.client_app import keep_entries

    task.train(again, task.train_set, TrainSettings(local_epochs=1, batch_size=16, lr=0.1), torch.Generator())
    odd = Context(run_id=1, node_id=2, node_config={}, state=RecordDict(), run_config={})
    keep_entries(odd, {"bn.running_mean": torch.zeros(99), "bn.running_var": torch.ones(99)})  # (no longer fits)
    model = global_model_from(task, layout, task.init_weights(3), odd, private=False, seed=3)
    for name, value in task.initial_local(3).items():  # skipped: the start, not the last node's trained statistics
        assert torch.equal(model.state_dict()[name], value), name


class _Head(_ImageTask):
    keep_local = ("fc.*",)  # a personal output layer: drawn at random when built


def test_a_kept_parameter_starts_from_the_run_seeds_model_on_every_instance_and_thread():
    """A personal head's first value is the model ``init_weights(seed)`` builds, whichever task instance or thread
    serves the node (it was the first value the instance's working model happened to draw)."""
    import threading

    a, b = _Head(), _Head()
    torch.manual_seed(1)
    a.working_model(torch.device("cpu"))  # instances that drew their working models from other random states
    torch.manual_seed(2)
    b.working_model(torch.device("cpu"))
    seen = []
    thread = threading.Thread(target=lambda: seen.append(b.initial_local(7)))
    thread.start()
    thread.join()
    names = set(a.layout().local)
    assert names == {"fc.weight", "fc.bias"} and seen[0].keys() == a.initial_local(7).keys() == names
    for name in names:
        assert torch.equal(a.initial_local(7)[name], seen[0][name]), name
        assert not torch.equal(a.initial_local(7)[name], a.initial_local(8)[name]), name  # the seed's draw
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        built = a.build()
    assert torch.equal(a.initial_local(7)["fc.weight"], built.fc.weight.detach())


def test_a_task_with_its_own_loop_gets_a_fresh_model_each_time():
    class OwnLoop(_ImageTask):
        def train(self, model, data, settings, generator):
            model.extra = torch.nn.Linear(1, 1)  # a loop may change its module
            return {}

    task = OwnLoop()
    assert task.working_model(torch.device("cpu")) is not task.working_model(torch.device("cpu"))


class _FedBN(_ImageTask):
    federate_buffers = False


def test_a_reused_model_trains_every_node_as_a_fresh_one_would(tmp_path, monkeypatch):
    """FedBN nodes (each keeps its BatchNorm statistics, and its federated evaluation reads them) in a simulated
    run: the same run, to the bit, whether each node's model is the last node's, reset, or one built for it."""
    from simulations import simulate

    def run(name):
        return simulate(_FedBN, run_dir=tmp_path / name, engine="inprocess", num_supernodes=3, num_rounds=2,
                        min_nodes=3, partitioning="iid", local_epochs=1, lr=0.1, federated_eval_every=1)

    reused = run("reused")
    monkeypatch.setattr(_FedBN, "working_model", lambda self, device: self.build().to(device))
    fresh = run("fresh")
    assert reused["final_test_loss"] == fresh["final_test_loss"] and math.isfinite(fresh["final_test_loss"])
    rows = [(tmp_path / name / "metrics.csv").read_text().splitlines() for name in ("reused", "fresh")]
    head = rows[0][0].split(",")
    for a, b in zip(rows[0][1:], rows[1][1:], strict=True):  # the clients' own evaluation on their statistics
        fed = {h: (x, y) for h, x, y in zip(head, a.split(","), b.split(","), strict=True)
               if h.startswith("fed") and h != "fed_eval_metrics"}  # (none: the task has no metric but accuracy)
        assert fed and all(x == y and x for x, y in fed.values()), fed


class _Dropout(Task):
    """A model that draws from torch's global generator in training (dropout), with the default loop."""

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3))

    def load_data(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 4)).astype(np.float32)
        return Dataset(x, (x[:, 0] > 0).astype(np.int64)), Dataset(x[:8], np.zeros(8, np.int64))


def test_training_draws_torchs_global_generator_from_the_nodes_seed_and_leaves_it_as_it_was():
    from clients import TrainSettings
    from clients.tasks import timed_train

    task = _Dropout()
    settings = TrainSettings(local_epochs=2, batch_size=8, lr=0.1)

    def trained(seed: int, noise: int) -> torch.Tensor:
        torch.manual_seed(noise)  # whatever state the process is in (another client, the coordinator)
        model = task.build()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.1)
        before = torch.get_rng_state()
        timed_train(task, model, task.train_set, settings, torch.Generator().manual_seed(seed))
        assert torch.equal(torch.get_rng_state(), before)  # the caller's generator is untouched
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    first = trained(1, noise=0)
    assert torch.equal(first, trained(1, noise=99))  # a rerun (or resume) repeats the dropout masks
    assert not torch.equal(first, trained(2, noise=0))  # another node or round draws others
