"""The public Task API: selection by name, import path or class; one-line errors for a task that does not
import or build; the layout of models with buffers; data of any shape; a node's own task; a regression
task with its own loss run from Python (simulations.simulate)."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest
import torch
from torch import nn

from clients import ClientError, ConfigError, Dataset, Task, TaskSpec, TrainSettings
from clients.client_app import node_task
from clients.tasks import ModelLayout, load_task, task_class, task_name
from simulations import simulate


class Regression(Task):
    """y = x @ w + noise, float targets, MSE: no accuracy, a loss of its own."""

    y_dtype = "float32"

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1), nn.Flatten(0))

    def load_data(self):
        rng = np.random.default_rng(self.spec.data_seed)
        x = rng.normal(size=(600, 5)).astype(np.float32)
        y = x @ np.array([1.0, -2.0, 0.5, 0.0, 3.0], np.float32) + rng.normal(0, 0.1, 600).astype(np.float32)
        return Dataset(x[:500], y[:500]), Dataset(x[500:], y[500:])

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


def test_a_regression_task_defined_here_runs_from_python(tmp_path):
    s = simulate(Regression, run_dir=tmp_path / "reg", num_supernodes=4, num_rounds=5, partitioning="iid",
                 local_epochs=2, lr=0.05)
    assert s["rounds"] == 5 and math.isnan(s["final_test_accuracy"])
    assert 0.0 < s["final_test_loss"] < 1.0  # the target's variance is ~14: it learnt (noise floor 0.01)


class Ratings(Task):
    """A recommender: user and item embeddings with sparse gradients, ratings by MSE."""

    x_dtype, y_dtype, num_classes, sparse = "int64", "float32", None, True

    def build_model(self) -> nn.Module:
        return _Dot(nn.ModuleDict({"u": nn.Embedding(40, 4, sparse=self.sparse),
                                   "i": nn.Embedding(30, 4, sparse=self.sparse)}))

    def load_data(self):
        rng = np.random.default_rng(0)
        x = np.stack([rng.integers(0, 40, 200), rng.integers(0, 30, 200)], 1)
        y = np.cos(x[:, 0] * 0.3 + x[:, 1]).astype(np.float32)
        return Dataset(x[:150], y[:150]), Dataset(x[150:], y[150:])

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)


class _Dot(nn.Module):
    def __init__(self, embeddings: nn.ModuleDict) -> None:
        super().__init__()
        self.e = embeddings

    def forward(self, x):
        return (self.e["u"](x[:, 0]) * self.e["i"](x[:, 1])).sum(1)


class DenseRatings(Ratings):
    sparse = False


@pytest.mark.parametrize("mu", [0.0, 0.5])
def test_sparse_embedding_gradients_train_as_dense_ones_fedprox_included(mu):
    """The default loop takes a sparse gradient (FedProx's term failed on it: add(sparse, dense)) and steps it,
    momentum included, to what the dense gradient gives."""
    from clients import TrainSettings

    got = []
    for task in (Ratings(), DenseRatings()):
        model = task.build_model()
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.normal_(p)
        task.train(model, task.train_set, TrainSettings(local_epochs=2, batch_size=16, lr=0.05, momentum=0.9,
                                                        proximal_mu=mu), torch.Generator().manual_seed(1))
        got.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, rule", [
    ("no_such_module_xyz:Task", "must import. Found ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ("json:dumps", "must name a subclass of clients.Task in json. Found function under 'dumps'"),
    ("json:Nothing", "Found nothing under 'Nothing'"),
    ("/no/such/file.py:T", "must name an existing Python file. Found no file '/no/such/file.py'"),
])
def test_a_task_that_does_not_import_is_one_line(name, rule):
    task_class.cache_clear()
    with pytest.raises(ConfigError, match=rule.replace("(", r"\(").replace(")", r"\)")) as info:
        load_task(TaskSpec(task=name))
    assert "\n" not in str(info.value)


def test_a_task_file_that_raises_or_builds_nothing_is_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError, match=r"must import. Found RuntimeError: no GPU here"):
        load_task(TaskSpec(task=f"{bad}:T"))
    odd = tmp_path / "odd.py"
    odd.write_text("from clients import Task, Dataset\nimport numpy as np\n"
                   "class T(Task):\n    def build_model(self): return 3\n"
                   "    def load_data(self):\n        d = Dataset(np.zeros((4, 2)), np.zeros(4, int))\n        return d, d\n")
    with pytest.raises(ClientError, match="build_model must return a torch.nn.Module. Found int"):
        load_task(TaskSpec(task=f"{odd}:T"))


class BnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.bn = nn.BatchNorm1d(4)
        self.out = nn.Linear(4, 3)
        self.out2 = self.out  # tied: counted once

    def forward(self, x):
        return self.out(self.bn(self.emb(x)))


def test_the_layout_takes_parameters_and_float_buffers_once_and_leaves_integers_local():
    model = BnNet()
    lay = ModelLayout.of(model)
    assert lay.names == ("emb.weight", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
                         "out.weight", "out.bias")
    assert lay.local == () and lay.numel == 40 + 4 * 4 + 12 + 3  # the batch count: unused under momentum 0.1
    assert lay.nonneg == ("bn.running_var",)  # the coordinator keeps it >= 0 (not running_mean, not a parameter)
    assert lay.index(buffers=True).tolist() == list(range(48, 56)) and lay.index(lay.nonneg).tolist() == [52, 53, 54, 55]
    assert ModelLayout.of(nn.Sequential(nn.Linear(2, 2), nn.InstanceNorm1d(2))).nonneg == ()  # no running stats
    cumulative = BnNet()
    cumulative.bn.momentum = None  # a cumulative average reads its batch count: each client keeps it
    assert ModelLayout.of(cumulative).local == ("bn.num_batches_tracked",)
    flat = torch.arange(lay.numel, dtype=torch.float32)
    other = BnNet()
    lay.load(other, flat)
    assert torch.equal(lay.flatten(other), flat) and torch.equal(other.bn.running_var, flat[52:56])
    fedbn = ModelLayout.of(model, federate_buffers=False, keep_local=("bn.*",))
    assert fedbn.names == ("emb.weight", "out.weight", "out.bias") and "bn.running_mean" in fedbn.local
    model.bn.num_batches_tracked += 7
    fresh = BnNet()
    fedbn.load_local(fresh, fedbn.local_state(model))
    assert int(fresh.bn.num_batches_tracked) == 7 and torch.equal(fresh.bn.weight, model.bn.weight)


def test_a_nodes_kept_entries_round_trip_through_its_context():
    """keep_entries stores each kept entry flat (read back at the npy header's offset); load_local gives it its
    shape; bfloat16 is kept as float32 and cast back; a record of the earlier shaped format still loads."""
    from flwr.app import ArrayRecord, Context, RecordDict

    from clients.client_app import LOCAL_STATE, keep_entries, kept_entries

    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    assert kept_entries(ctx) == {}
    model = BnNet().to(torch.bfloat16)
    model.bn.running_mean.copy_(torch.tensor([0.5, -1.25, 3.0, 0.125]))
    model.bn.num_batches_tracked += 9
    lay = ModelLayout.of(model, federate_buffers=False, keep_local=("bn.*",))
    keep_entries(ctx, lay.local_state(model))
    kept = kept_entries(ctx)
    assert kept["bn.running_mean"].dtype == torch.float32 and kept["bn.num_batches_tracked"].shape == (1,)
    fresh = BnNet().to(torch.bfloat16)
    lay.load_local(fresh, kept)
    assert torch.equal(fresh.bn.running_mean, model.bn.running_mean) and int(fresh.bn.num_batches_tracked) == 9
    ctx.state[LOCAL_STATE] = ArrayRecord({"bn.num_batches_tracked": torch.tensor(4), "bn.running_var": torch.ones(4)})
    lay.load_local(fresh, kept_entries(ctx))  # (the shaped form, as sessions before 26 kept it)
    assert int(fresh.bn.num_batches_tracked) == 4 and torch.equal(fresh.bn.running_var, torch.ones(4, dtype=torch.bfloat16))
    lay.load_local(fresh, {"bn.running_var": torch.zeros(3)})  # another size: left as it was
    assert torch.equal(fresh.bn.running_var, torch.ones(4, dtype=torch.bfloat16))


def test_half_precision_entries_travel_as_float32_and_come_back_in_their_dtype():
    model = nn.Linear(3, 2).to(torch.bfloat16)
    lay = ModelLayout.of(model)
    flat = lay.flatten(model)
    assert flat.dtype == torch.float32 and flat.numel() == 8
    lay.load(model, flat + 1)
    assert model.weight.dtype == torch.bfloat16


def test_data_of_any_shape_is_checked_against_the_task():
    class Images(Task):
        input_shape, num_classes = (1, 8, 8), 10

        def build_model(self): return nn.Flatten()

        def load_data(self): raise NotImplementedError

    ok = Images.check_data(Dataset(np.zeros((3, 1, 8, 8), np.float64), np.array([0, 9, 3])), "f.npz")
    assert ok.x.dtype == np.float32 and ok.x.shape == (3, 1, 8, 8)
    with pytest.raises(ClientError, match=r"f.npz: x must have shape \(n, 1, 8, 8\)"):
        Images.check_data(Dataset(np.zeros((3, 64)), np.array([0, 1, 2])), "f.npz")
    with pytest.raises(ClientError, match=r"integer labels in \[0, 10\)"):
        Images.check_data(Dataset(np.zeros((1, 1, 8, 8)), np.array([10])), "f.npz")


def test_a_node_trains_only_the_task_its_owner_named():
    spec = TaskSpec(task="/coordinator/side/cnn.py:CnnDigits")
    assert node_task(spec, {}) == spec  # a simulated node: the run's task
    own = node_task(spec, {"task": "/device/side/cnn.py:CnnDigits"})
    assert own.task == "/device/side/cnn.py:CnnDigits"  # the owner's file, the coordinator's other settings
    with pytest.raises(ClientError, match="this node trains task 'mine.tasks:Other'"):
        node_task(spec, {"task": "mine.tasks:Other"})
    with pytest.raises(ClientError, match="built-in tasks only"):
        node_task(spec, {"task": "builtin"})
    assert node_task(TaskSpec(task="digits"), {"task": "builtin"}).task == "digits"


def test_a_class_is_named_by_its_module_and_a_nested_one_still_resolves():
    assert task_name(Regression) == f"{__name__}:Regression"

    class Inner(Regression):
        pass

    name = task_name(Inner)
    assert name.startswith(f"{__name__}:Inner_") and task_class(name) is Inner
    with pytest.raises(ConfigError, match="subclass of clients.Task"):
        task_name(int)


class _PositionsAndNorm(Task):
    """BatchNorm (Opacus swaps it for GroupNorm) and a parameter held by the model itself."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
            self.shift = nn.Parameter(torch.zeros(2))

        def forward(self, x):
            return self.layers(x) + self.shift

    def build_model(self):
        return self.Net()

    def load_data(self):
        x = np.zeros((8, 4), np.float32)
        return Dataset(x, np.zeros(8, np.int64)), Dataset(x, np.zeros(8, np.int64))


def test_what_local_dp_changes_in_a_model_is_said_once_per_task(caplog):
    task = _PositionsAndNorm()
    with caplog.at_level(logging.INFO):
        models = [task.build(private=True) for _ in range(3)]
    said = [r.getMessage() for r in caplog.records if "local DP: task" in r.getMessage()]
    assert all(any(isinstance(m, nn.GroupNorm) for m in model.modules()) for model in models)
    assert len(said) == 1 and "changed for DP-SGD by Opacus (BatchNorm1d -> GroupNorm)" in said[0], said


class DictOutput(Regression):
    """A model whose forward returns a dict (as many libraries' models do), read by the task's own loss; the
    default metrics find no class scores in it and give none."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1), nn.Flatten(0))

        def forward(self, x):
            return {"prediction": self.body(x), "features": x}

    def build_model(self) -> nn.Module:
        return self.Net()

    def loss(self, output, target):
        return nn.functional.mse_loss(output["prediction"], target)


@dataclasses.dataclass
class Prediction:
    """An output object, as libraries' models return (a dataclass of tensors; vmap takes none)."""

    value: torch.Tensor
    features: torch.Tensor | None = None


class DataclassOutput(DictOutput):
    class Net(DictOutput.Net):
        def forward(self, x):
            return Prediction(self.body(x), x)

    def loss(self, output, target):
        return nn.functional.mse_loss(output.value, target)


class BrokenEvaluate(Regression):
    def evaluate(self, model, data, batch_size=1024):
        return {"loss": float(model(torch.from_numpy(data.x)).sum()), "odd": 1 / 0}


@pytest.mark.parametrize("batched", [True, False])
def test_a_model_with_a_dict_output_trains_and_its_result_is_its_loss(tmp_path, batched):
    from coordinator.progress import result_text

    s = simulate(DictOutput, run_dir=tmp_path / "dict", num_supernodes=4, num_rounds=3, partitioning="iid",
                 local_epochs=2, lr=0.05, batched=batched)
    assert s["rounds"] == 3 and s["rejected_total"] == 0 and s["final_test_metrics"] == {}
    assert 0.0 < s["final_test_loss"] < 1.0
    assert result_text(s) == f"test loss {s['final_test_loss']:.4g}"
    from simulations.reports import format_runs, list_runs  # fedshield runs: its loss too, not "-"

    row = format_runs(list_runs(str(tmp_path)), str(tmp_path)).splitlines()[1].split()
    assert row[3:5] == [f"loss={s['final_test_loss']:.4g}", "-"], row


def test_an_output_object_trains_batched_as_one_by_one(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        runs = [simulate(DataclassOutput, run_dir=tmp_path / str(b), num_supernodes=4, num_rounds=2, partitioning="iid",
                         local_epochs=2, lr=0.05, batched=b) for b in (True, False)]
    assert not [r for r in caplog.records if "train one at a time" in r.getMessage()]  # (it fell back before)
    assert runs[0]["final_test_loss"] == pytest.approx(runs[1]["final_test_loss"], rel=1e-5)
    assert 0.0 < runs[0]["final_test_loss"] < 3.0 and runs[0]["rejected_total"] == 0


def test_an_evaluate_that_fails_stops_the_run_in_one_line_before_any_training(tmp_path):
    with pytest.raises(ConfigError) as info:
        simulate(BrokenEvaluate, run_dir=tmp_path / "broken", num_supernodes=2, num_rounds=2, partitioning="iid")
    said = str(info.value)
    assert said.startswith(f"task {task_name(BrokenEvaluate)!r} must evaluate the model on the coordinator's test "
                           "data (before round 1). Found ZeroDivisionError: division by zero (")
    assert "test_task_api.py:" in said and "in evaluate)" in said and "\n" not in said
    assert not (tmp_path / "broken" / "metrics.csv").exists()  # no round ran


class FrozenFeatures(Regression):
    """Random features (a frozen layer drawn at build) and a trained head: a fine-tuned model's shape."""

    def build_model(self) -> nn.Module:
        features = nn.Linear(5, 64)
        features.requires_grad_(False)
        return nn.Sequential(features, nn.Tanh(), nn.Linear(64, 1), nn.Flatten(0))


class FrozenFeaturesOnTheWire(FrozenFeatures):
    federate_frozen = True


class UnfreezingLoop(FrozenFeatures):
    def train(self, model, data, settings, generator):
        model[0].requires_grad_(True)  # a loop that unfreezes what was frozen at build
        return super().train(model, data, settings, generator)


@pytest.mark.parametrize("batched", [True, False])
def test_frozen_parameters_stay_off_the_wire_and_the_model_is_the_same(tmp_path, batched):
    runs = {cls: simulate(cls, run_dir=tmp_path / cls.__name__, num_supernodes=4, num_rounds=3, partitioning="iid",
                          local_epochs=2, lr=0.05, batched=batched) for cls in (FrozenFeatures, FrozenFeaturesOnTheWire)}
    off, on = runs[FrozenFeatures], runs[FrozenFeaturesOnTheWire]
    assert FrozenFeatures().layout().fixed == ("0.weight", "0.bias")
    assert (off["num_parameters"], on["num_parameters"]) == (65, 64 * 5 + 64 + 65)
    assert off["total_bytes_down"] < on["total_bytes_down"] / 4  # (65 against 449 numbers a client)
    assert 0.0 < off["final_test_loss"] < 10.0  # it learnt (the targets' variance is ~14)
    assert off["final_test_loss"] == pytest.approx(on["final_test_loss"], rel=1e-4)  # the same model either way
    saved = torch.load(tmp_path / "FrozenFeatures" / "model.pt")
    torch.testing.assert_close(saved["0.weight"], FrozenFeatures().initial_local(0)["0.weight"])  # the seed's build


def test_a_loop_that_changes_a_frozen_parameter_is_refused_in_one_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        s = simulate(UnfreezingLoop, run_dir=tmp_path / "unfreeze", num_supernodes=2, num_rounds=1,
                     partitioning="iid")
    assert s["rejected_by_rule"] == {"error-reply": 2} and s["status"] == "no-updates", s
    said = [r.getMessage() for r in caplog.records if "was frozen when built" in r.getMessage()]
    assert said and "parameter '0.weight' was frozen when built (requires_grad=False)" in said[0]
    assert "set federate_frozen = True on the task" in said[0]


class NumpyFeatures(FrozenFeatures):
    """Frozen features drawn from numpy's unseeded generator: each process builds others."""

    def build_model(self) -> nn.Module:
        model = super().build_model()
        with torch.no_grad():
            model[0].weight.copy_(torch.from_numpy(np.random.default_rng().normal(size=(64, 5))))
        return model


def test_a_node_whose_frozen_entries_differ_from_the_coordinators_refuses():
    import dataclasses

    from flwr.app import ArrayRecord, Context, Message, RecordDict

    from aggregation import tensor_to_array
    from clients import TrainInstruction, TrainSettings
    from clients.client_app import global_weights
    from clients.protocol import ARRAYS, CONFIG, MESSAGE_TYPE_TRAIN, WEIGHTS
    from clients.tasks.layout import frozen_match, frozen_summary

    task = FrozenFeatures()
    summary = task.frozen_summary(0)
    assert len(summary) == 12 and summary == FrozenFeatures().frozen_summary(0)
    assert not frozen_match(summary, task.frozen_summary(1))  # another seed's build
    assert not frozen_match(summary, NumpyFeatures().frozen_summary(0))  # numpy's draws
    start = task.initial_local(0)
    noisy = [t + 1e-7 * torch.randn(t.shape) for t in (start["0.weight"], start["0.bias"])]  # another CPU's bits
    assert frozen_match(summary, frozen_summary(noisy))
    assert FrozenFeaturesOnTheWire().frozen_summary(0) == () and Regression().frozen_summary(0) == ()
    instr = TrainInstruction(round=1, version=0, seed=0, task=TaskSpec(task=task_name(FrozenFeatures),
                             partitioning="iid"), train=TrainSettings(), frozen=summary)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 4}, state=RecordDict(),
                  run_config={})

    def message(instruction):
        return Message(RecordDict({ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(task.init_weights(0))}),
                                   CONFIG: instruction.to_record()}), dst_node_id=1, message_type=MESSAGE_TYPE_TRAIN)

    assert global_weights(message(instr), ctx, private=False)[0].frozen == summary  # the same build: accepted
    for other in (frozen_summary(noisy), ):  # float noise passes
        global_weights(message(dataclasses.replace(instr, frozen=other)), ctx, private=False)
    for other in (NumpyFeatures().frozen_summary(0), ()):  # another build, or none sent
        with pytest.raises(ClientError, match=r"frozen parameters this node builds \(0.weight, 0.bias\) differ from "
                                              "the coordinator's"):
            global_weights(message(dataclasses.replace(instr, frozen=other)), ctx, private=False)


class NeedsManyExamples(Regression):
    """An evaluate that needs more than a handful of examples (a metric over both classes, long windows)."""

    def evaluate(self, model, data, batch_size=1024):
        if len(data) < 20:
            raise ValueError(f"needs 20 examples, got {len(data)}")
        return super().evaluate(model, data, batch_size)


class AllFrozen(Regression):
    def build_model(self) -> nn.Module:
        return super().build_model().requires_grad_(False)


def test_the_check_before_round_1_takes_the_whole_test_set_where_8_examples_are_too_few(tmp_path):
    s = simulate(NeedsManyExamples, run_dir=tmp_path / "many", num_supernodes=2, num_rounds=1, partitioning="iid")
    assert s["rounds"] == 1 and math.isfinite(s["final_test_loss"])


def test_a_model_with_nothing_to_federate_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"must have something to federate.*every parameter is frozen.*"
                                          "federate_frozen = True"):
        load_task(TaskSpec(task=task_name(AllFrozen)))


class TinyTransformer(Task):
    """Next-token over a 16-token vocabulary: a 1-layer Transformer with dropout and its positions held by the
    model itself as a parameter (the shape that Opacus's per-layer hooks would replay, and vmap trains)."""

    x_dtype = "int64"
    num_classes = 16

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos = nn.Embedding(16, 16), nn.Parameter(torch.zeros(6, 16))
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
            self.head = nn.Linear(16, 16)

        def forward(self, x):
            return self.head(self.enc(self.emb(x) + self.pos)[:, -1])

    def build_model(self) -> nn.Module:
        return self.Net()

    def load_data(self):
        rng = np.random.default_rng(0)
        x = rng.integers(0, 16, (400, 6))
        y = (x[:, -1] + x[:, -2]) % 16  # learnable from the last two tokens
        return Dataset(x[:320], y[:320]), Dataset(x[320:], y[320:])


def test_a_transformer_with_dropout_reruns_the_same_and_trains_under_local_dp(tmp_path):
    settings = dict(num_supernodes=4, num_rounds=2, partitioning="iid", lr=0.05, local_epochs=1, batch_size=16)
    first, again = (simulate(TinyTransformer, run_dir=tmp_path / f"run{i}", **settings) for i in (1, 2))
    assert first["rejected_total"] == 0 and first["final_test_loss"] == again["final_test_loss"]  # dropout seeded
    private = simulate(TinyTransformer, run_dir=tmp_path / "ldp", dp="local", local_noise_multiplier=0.5,
                       **settings)
    assert private["rejected_total"] == 0 and private["local_epsilon_max"] > 0, private
    assert math.isfinite(private["final_test_loss"])


class TensorLossLoop(Regression):
    """An own loop that returns its loss as a tensor (and a numpy value), as many loops do."""

    def train(self, model, data, settings, generator):
        out = super().train(model, data, settings, generator)
        return {"train-loss": torch.tensor(out["train-loss"]), "steps": np.int64(3)}


def test_an_own_loops_loss_as_a_tensor_is_recorded(tmp_path):
    import csv

    simulate(TensorLossLoop, run_dir=tmp_path / "t", num_supernodes=2, num_rounds=2, partitioning="iid")
    with open(tmp_path / "t" / "metrics.csv", newline="") as fh:
        losses = [float(row["train_loss"]) for row in csv.DictReader(fh)]
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses), losses


class LazyCnn(Task):
    """Lazy layers (sizes set by a first forward), BatchNorm among them: fedshield runs that forward on zeros of
    ``input_shape``."""

    num_classes, input_shape = 3, (1, 6, 6)

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.LazyConv2d(4, 3, padding=1), nn.LazyBatchNorm2d(), nn.ReLU(), nn.Flatten(),
                             nn.LazyLinear(3))

    def load_data(self):
        rng = np.random.default_rng(0)
        y = rng.integers(0, 3, 300)
        x = (rng.normal(size=(300, 1, 6, 6)) + y[:, None, None, None] * 0.5).astype(np.float32)
        return Dataset(x[:240], y[:240]), Dataset(x[240:], y[240:])


class DoublePrecision(Regression):
    """A float64 model on float64 inputs (x_dtype), as scientific regressions are."""

    x_dtype = "float64"

    def build_model(self) -> nn.Module:
        return super().build_model().double()

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target.double())


@pytest.mark.parametrize("batched", [True, False])
def test_lazy_modules_are_sized_from_input_shape_and_train(tmp_path, batched):
    task = LazyCnn()
    assert task.num_parameters() == (4 * 9 + 4) + 4 * 4 + (4 * 36 * 3 + 3)  # conv, BatchNorm (2 + 2 stats), linear
    assert torch.equal(task.init_weights(0), task.init_weights(0))
    assert not torch.equal(task.init_weights(0), task.init_weights(1))
    s = simulate(LazyCnn, run_dir=tmp_path / "lazy", num_supernodes=3, num_rounds=2, lr=0.05, batched=batched)
    assert s["rejected_total"] == 0 and 0.4 <= s["final_test_accuracy"] <= 1.0

    class Kept(LazyCnn):
        x_dtype = None  # (one input kept as it comes: sized with float32 zeros)

    assert Kept().num_parameters() == task.num_parameters()

    class Unsized(LazyCnn):
        input_shape = None

    with pytest.raises(ClientError, match=r"build_model returns lazy modules \(LazyConv2d '0'\), whose sizes a first "
                                          r"forward sets: set the task's input_shape"):
        Unsized().num_parameters()


def test_a_float64_model_trains_and_an_unknown_dtype_is_one_line(tmp_path):
    s = simulate(DoublePrecision, run_dir=tmp_path / "f64", num_supernodes=3, num_rounds=3, partitioning="iid",
                 local_epochs=2, lr=0.05)
    assert s["rejected_total"] == 0 and 0.0 < s["final_test_loss"] < 2.0

    class Odd(Regression):
        x_dtype = "float8"

    with pytest.raises(ClientError, match="x_dtype must be one of float32, int64, float64, float16, bool or None "
                                          r"\(or a dict of them by input name\). Found 'float8'"):
        Odd.check_data(Dataset(np.zeros((2, 5)), np.zeros(2)), "f")


class Flipped(LazyCnn):
    """LazyCnn's images flipped left-right at random and noised, per example, from the node's generator."""

    input_shape = (1, 6, 6)
    calls = 0

    def augment(self, x, y, generator):
        type(self).calls += 1
        flip = torch.rand(len(y), generator=generator) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return x + 0.05 * torch.randn(x.shape, generator=generator), y


class Dropping(Flipped):
    def augment(self, x, y, generator):
        return x[1:], y[1:]


def test_augment_transforms_each_training_batch_reproducibly_on_every_path(tmp_path, caplog):
    settings = dict(num_supernodes=3, num_rounds=2, lr=0.05, local_epochs=2)
    plain = simulate(LazyCnn, run_dir=tmp_path / "plain", batched=False, **settings)
    with caplog.at_level(logging.INFO):
        runs = [simulate(Flipped, run_dir=tmp_path / str(b), batched=b, **settings) for b in (True, False)]
    assert any("augments its batches (Task.augment)" in r.getMessage() for r in caplog.records)  # one at a time
    assert runs[0]["final_test_loss"] == runs[1]["final_test_loss"] != plain["final_test_loss"]  # seeded draws
    assert all(s["rejected_total"] == 0 and 0.4 <= s["final_test_accuracy"] <= 1.0 for s in runs)
    Flipped.calls = 0
    private = simulate(Flipped, run_dir=tmp_path / "ldp", dp="local", local_noise_multiplier=0.5, **settings)
    assert private["rejected_total"] == 0 and Flipped.calls > 0 and private["local_epsilon_max"] > 0
    bad = simulate(Dropping, run_dir=tmp_path / "bad", **{**settings, "num_rounds": 1})
    assert bad["rejected_total"] == 3
    assert any("augment must return (x, y) with the" in r.getMessage() for r in caplog.records)


class _RunningMean(nn.Module):
    """A layer that keeps a running mean of its inputs in a buffer, written in its forward (as BatchNorm does)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 16)
        self.register_buffer("mean", torch.zeros(5))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.lin(x - self.mean)


class RunningStats(Regression):
    def build_model(self) -> nn.Module:
        return nn.Sequential(_RunningMean(), nn.Tanh(), nn.Linear(16, 1), nn.Flatten(0))


class RunningStatsLocal(RunningStats):
    keep_local = ("0.mean",)


class SpectralNormed(Regression):
    """spectral_norm's vectors are buffers its forward rewrites from the weights alone: they travel, as they may."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.utils.spectral_norm(nn.Linear(5, 16)), nn.Tanh(), nn.Linear(16, 1), nn.Flatten(0))


def test_under_local_dp_a_statistic_the_forward_writes_is_refused_before_training(tmp_path, caplog):
    """A buffer written from each batch (a running mean of the inputs) lets one example move the others' gradients:
    Opacus's hooks trained such a model and sent the mean un-noised. Now each node refuses before it trains or
    charges its ledger, the buffer kept or sent; buffers written from the weights alone (spectral_norm) pass."""
    private = dict(num_supernodes=3, num_rounds=1, partitioning="iid", dp="local", local_noise_multiplier=0.5)
    for cls in (RunningStats, RunningStatsLocal):
        s = simulate(cls, run_dir=tmp_path / cls.__name__, **private)
        assert s["rejected_total"] == 3 and not (s.get("local_epsilon_max") or 0) > 0  # (nothing charged)
    assert any("local DP: '0.mean' is written from each batch in the forward" in r.getMessage()
               for r in caplog.records)
    normed = simulate(SpectralNormed, run_dir=tmp_path / "sn", **private)
    assert normed["rejected_total"] == 0 and normed["local_epsilon_max"] > 0
    from clients.dp_training import data_dependent_state

    model = RunningStats().build_model()
    x = torch.randn(4, 5)
    assert data_dependent_state(model, x) == ["0.mean"] and torch.equal(model[0].mean, torch.zeros(5))
    assert data_dependent_state(model, x[:1]) == ["0.mean"]  # (one example: compared with zeros)
    assert data_dependent_state(SpectralNormed().build_model(), x) == []


def test_a_task_file_imports_the_modules_beside_it(tmp_path):
    """A new user split a task into model.py and task.py: `from model import Net` was ModuleNotFoundError."""
    (tmp_path / "fedshield_test_sibling_model.py").write_text("from torch import nn\nWIDTH = 7\n")
    (tmp_path / "task.py").write_text(
        "from fedshield_test_sibling_model import WIDTH\nfrom clients.tasks.digits import DigitsTask\n\n"
        "class Wide(DigitsTask):\n    width = WIDTH\n")
    assert task_class(f"{tmp_path / 'task.py'}:Wide").width == 7
