"""Train message contents: TrainInstruction records and parse_train_message."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregation import tensor_to_array
from clients import ClientError, ConfigError, TaskSpec, TrainInstruction, TrainSettings
from clients.tasks import get_task
from clients.protocol import (
    ARRAYS,
    CONFIG,
    MESSAGE_TYPE_TRAIN,
    METRICS,
    WEIGHTS,
    message_nbytes,
    parse_train_message,
    record_of,
    records_of,
    train_reply_content,
)


@pytest.fixture(autouse=True, scope="module")
def task_identity():
    from simulations.inprocess import ensure_task_identity

    ensure_task_identity()


def _instruction(**kw) -> TrainInstruction:
    fields = dict(round=3, version=2, seed=11, task=TaskSpec(task="synthetic", partitioning="iid", data_seed=4),
                  train=TrainSettings(local_epochs=2, batch_size=8, lr=0.25, momentum=0.5))
    fields.update(kw)
    return TrainInstruction(**fields)


def _message(content: RecordDict) -> Message:
    return Message(content, dst_node_id=1001, message_type=MESSAGE_TYPE_TRAIN)


def _weights() -> ArrayRecord:
    return ArrayRecord({WEIGHTS: tensor_to_array(torch.arange(4, dtype=torch.float32))})


@settings(max_examples=40, deadline=None)
@given(
    rnd=st.integers(0, 2**40), version=st.integers(0, 2**40), seed=st.integers(0, 2**62),
    task=st.builds(TaskSpec, task=st.sampled_from(["digits", "synthetic"]),
                   partitioning=st.sampled_from(["iid", "dirichlet"]), dirichlet_alpha=st.floats(1e-3, 1e3),
                   data_seed=st.integers(0, 2**31)),
    train=st.builds(TrainSettings, local_epochs=st.integers(1, 1000), batch_size=st.integers(1, 65536),
                    lr=st.floats(1e-6, 100), momentum=st.floats(0, 0.999)),
)
def test_record_round_trip(rnd, version, seed, task, train):
    instr = TrainInstruction(round=rnd, version=version, seed=seed, task=task, train=train)
    record = instr.to_record()
    assert isinstance(record, ConfigRecord)
    assert TrainInstruction.from_record(record) == instr


def test_record_uses_kebab_keys():
    keys = set(_instruction().to_record())
    assert {"round", "version", "seed", "local-epochs", "batch-size", "data-seed", "dirichlet-alpha"} <= keys


def _record_without(key: str) -> ConfigRecord:
    fields = dict(_instruction().to_record())
    del fields[key]
    return ConfigRecord(fields)


def _record_with(**kw) -> ConfigRecord:
    fields = dict(_instruction().to_record())
    fields.update(kw)
    return ConfigRecord(fields)


@pytest.mark.parametrize("key", ["round", "version", "seed"])
def test_missing_counter_is_rejected(key):
    with pytest.raises(ConfigError, match=f"^{key} must be an integer >= 0. Found None."):
        TrainInstruction.from_record(_record_without(key))


def test_negative_version_is_rejected():
    with pytest.raises(ConfigError, match=r"^version must be an integer >= 0\. Found -1\."):
        TrainInstruction.from_record(_record_with(version=-1))


def test_float_round_is_rejected():
    with pytest.raises(ConfigError, match=r"^round must be an integer >= 0\. Found 1\.5\."):
        TrainInstruction.from_record(_record_with(round=1.5))


@pytest.mark.parametrize(("value", "rule"), [(-1.0, r"be in \(0, 100\]\. Found -1\.0\."),
                                             (0.0, r"be in \(0, 100\]"), ("fast", r"be a finite number")])
def test_bad_lr_is_rejected_naming_the_key(value, rule):
    with pytest.raises(ConfigError, match=rf"^config\.lr must {rule}"):
        TrainInstruction.from_record(_record_with(lr=value))


def test_bad_task_is_rejected():
    with pytest.raises(ConfigError, match=r"^config\.task must be one of"):
        TrainInstruction.from_record(_record_with(task="cifar"))


def test_missing_settings_take_defaults():
    record = ConfigRecord({"round": 1, "version": 0, "seed": 5})
    instr = TrainInstruction.from_record(record)
    assert instr.task == TaskSpec() and instr.train == TrainSettings()


def test_bool_round_is_rejected():
    with pytest.raises(ConfigError):
        TrainInstruction.from_record(_record_with(round=True))


# --------------------------------------------------------------------------- messages


def test_parse_train_message_returns_instruction_and_arrays():
    instr = _instruction()
    msg = _message(RecordDict({CONFIG: instr.to_record(), ARRAYS: _weights()}))
    parsed, arrays = parse_train_message(msg)
    assert parsed == instr
    assert WEIGHTS in arrays


@pytest.mark.parametrize("content", [
    lambda: RecordDict({}),
    lambda: RecordDict({ARRAYS: _weights()}),
    lambda: RecordDict({CONFIG: _instruction().to_record()}),
    lambda: RecordDict({"cfg": _instruction().to_record(), ARRAYS: _weights()}),
], ids=["empty", "no config", "no arrays", "misnamed config"])
def test_message_missing_records_raises(content):
    with pytest.raises(ClientError, match="train message must carry 'config' and 'arrays' records"):
        parse_train_message(_message(content()))


def test_message_without_weights_array_raises():
    arrays = ArrayRecord({"delta": tensor_to_array(torch.zeros(2))})
    msg = _message(RecordDict({CONFIG: _instruction().to_record(), ARRAYS: arrays}))
    with pytest.raises(ClientError, match=r"must carry array 'weights'\. Found \['delta'\]"):
        parse_train_message(msg)


def test_message_with_bad_config_raises_config_error():
    msg = _message(RecordDict({CONFIG: _record_with(lr=-1.0), ARRAYS: _weights()}))
    with pytest.raises(ConfigError, match="config.lr"):
        parse_train_message(msg)


def test_train_reply_content_layout():
    from aggregation.codecs import create_codec

    enc, _ = create_codec("topk", ratio=0.5).encode(torch.ones(4))
    content = train_reply_content(enc, {"num-examples": 10, "train-loss": 0.5})
    assert set(content.array_records[ARRAYS].keys()) == set(enc.arrays)
    assert dict(content.config_records["codec"]) == enc.header
    assert dict(content.metric_records[METRICS]) == {"num-examples": 10, "train-loss": 0.5}


def _train_message(weights: torch.Tensor, codec: dict | None = None) -> Message:
    content = RecordDict({CONFIG: _instruction().to_record(), ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(weights)})})
    if codec is not None:
        content["codec"] = ConfigRecord(codec)
    return _message(content)


def _context():
    from flwr.app import Context

    return Context(run_id=1, node_id=1001, node_config={"partition-id": 0, "num-partitions": 2}, state=RecordDict(),
                   run_config={})


def test_a_global_model_that_is_not_finite_is_refused_before_training():
    """It was trained for the whole round, and the NaN update then rejected by the coordinator."""
    from clients.client_app import run_train
    from clients.tasks import get_task

    numel = sum(p.numel() for p in get_task(_instruction().task).build_model().parameters())
    w = torch.zeros(numel)
    w[7] = float("nan")
    with pytest.raises(ClientError, match="global model must hold only finite values"):
        run_train(_train_message(w), _context())


@pytest.mark.parametrize("codec", [{"codec": "zstd"}, {"codec": "dense", "dtype": ["float32"]}])
def test_a_bad_codec_record_is_refused_before_any_training(monkeypatch, codec):
    """Refused only after local training (a wasted round, and local-DP steps charged for a reply never
    sent); a list-valued dtype raised a bare TypeError."""
    from clients import client_app

    monkeypatch.setattr(client_app, "local_update", lambda *a: pytest.fail("trained before the codec was checked"))
    with pytest.raises(ClientError, match="codec record must describe a known codec"):
        client_app.run_train(_train_message(torch.zeros(4), codec), _context())


def test_records_of_reads_what_the_typed_views_give_and_nbytes_counts_the_same():
    """``records_of`` stands in for Flower's ``config_records`` / ``array_records`` / ``metric_records`` views
    (which rebuild and type-check a dict on every access): same records, and a record of another kind under a
    name is not one of them."""
    content = RecordDict({CONFIG: ConfigRecord({"a": b"xyz", "n": 3}), ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(
        torch.ones(5))}), METRICS: MetricRecord({"num-examples": 4}), "codec": ArrayRecord({})})
    for kind, view in ((ConfigRecord, content.config_records), (ArrayRecord, content.array_records),
                       (MetricRecord, content.metric_records)):
        assert records_of(content, kind) == dict(view.items())
    assert "codec" not in records_of(content, ConfigRecord)
    assert record_of(content, CONFIG, ConfigRecord) is content[CONFIG]
    assert record_of(content, "codec", ConfigRecord) is None and record_of(content, "absent", ConfigRecord) is None
    msg = Message(content=content, dst_node_id=1, message_type=MESSAGE_TYPE_TRAIN)
    # every name and key, bytes by length, a number as 8: config {"a": b"xyz", "n": 3}, arrays {weights: its data,
    # dtype "float32", stype "numpy.ndarray", one dim}, metrics {"num-examples": 4}, an empty ArrayRecord under "codec"
    assert message_nbytes(msg) == ((len(CONFIG) + 1 + 3 + 1 + 8) + (len(ARRAYS) + len(WEIGHTS) + len(
        content[ARRAYS][WEIGHTS].data) + len("float32") + len("numpy.ndarray") + 8) + (len(METRICS) + len(
            "num-examples") + 8) + len("codec"))
    content[ARRAYS][WEIGHTS].__dict__["stype"] = "s" * (1 << 20)  # a declared layout of megabytes is counted
    assert message_nbytes(msg) > 1 << 20


def test_a_train_message_whose_config_is_not_a_config_record_is_refused():
    content = RecordDict({CONFIG: ArrayRecord({}), ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(torch.ones(2))})})
    with pytest.raises(ClientError, match="must carry 'config' and 'arrays' records"):
        parse_train_message(Message(content=content, dst_node_id=1, message_type=MESSAGE_TYPE_TRAIN))


# -- a buggy or hostile coordinator (a review): refusals, short reasons, nothing unbounded -------------------------
def _numel() -> int:
    return sum(p.numel() for p in get_task(_instruction().task).build_model().parameters())


@pytest.mark.parametrize("weights", [
    lambda n: Array(np.zeros(n, np.float64)),
    lambda n: Array(np.zeros(n + 1, np.float32)),
    lambda n: Array(np.zeros((n, 1), np.float32)),
    lambda n: Array(dtype="\x1b[2J" + "x" * 100_000, shape=(n,), stype="numpy.ndarray", data=b"\x00" * 4 * n),
    lambda n: Array(dtype="float32", shape=(n,), stype="s" * 100_000, data=b"\x00" * 4 * n),
])
def test_a_malformed_weights_array_is_a_short_refusal_not_an_exception(weights):
    """AggregationError went past the ClientApp (a traceback in the node's log, the class name as the reason),
    with the array's dtype or stype in full: 100 kB and a raw terminal escape."""
    from clients.client_app import run_train

    msg = _train_message(torch.zeros(4))
    msg.content[ARRAYS] = ArrayRecord({WEIGHTS: weights(_numel())})
    with pytest.raises(ClientError, match="'weights' must be the task's") as info:
        run_train(msg, _context())
    assert len(str(info.value)) < 400 and "\x1b" not in str(info.value)


def test_a_huge_model_asked_with_a_short_array_is_refused_before_it_is_built(monkeypatch):
    """hidden-units = 2**20 built a 78.6M-parameter model (300 MB) before the 4-element array was compared.
    Checked by where each model is built (the process's peak memory may be past 300 MB already)."""
    from clients.client_app import run_train
    from clients.tasks.digits import DigitsTask

    built, build = [], DigitsTask.build_model

    def recording(self):
        model = build(self)
        built.append(next(model.parameters()).device.type)
        return model

    monkeypatch.setattr(DigitsTask, "build_model", recording)
    instr = _instruction(task=TaskSpec(task="digits", hidden_units=1 << 20))
    msg = _message(RecordDict({CONFIG: instr.to_record(), ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(torch.zeros(4))})}))
    with pytest.raises(ClientError, match="'weights' must be the task's 78643210 float32 parameters"):
        run_train(msg, _context())
    assert built == ["meta"]


def test_a_diverged_update_is_a_refusal_not_an_encoder_exception():
    from clients.client_app import run_train

    with pytest.raises(ClientError, match="training diverged"):
        run_train(_train_message(torch.full((_numel(),), 3e38)), _context())


@pytest.mark.parametrize("record", [{"codec": "z" * 100_000}, {"codec": "dense", "d" * 100_000: 1}])
def test_a_long_codec_name_or_parameter_is_cut_in_the_reason(record):
    from clients.client_app import run_train

    with pytest.raises(ClientError) as info:
        run_train(_train_message(torch.zeros(4), record), _context())
    assert len(str(info.value)) < 1000


def test_metric_values_keep_real_numbers_under_plain_names_as_both_sides_record_them():
    from clients.protocol import MAX_EVAL_METRICS, metric_values

    out = {"rmse": np.float32(0.25), "n": 3, "mean": torch.tensor(1.5, requires_grad=True), "one": torch.ones(1),
           "flag": True, "npflag": np.bool_(True), "tflag": torch.tensor(True), "tensor": torch.ones(2),
           "text": "0.7", "nptext": np.str_("0.7"), "complex": np.complex128(1 + 2j), "huge": 10**400,
           "bad\x1bname": 1.0, "x" * 65: 1.0, "": 1.0, 7: 1.0, "acc": float("nan"), "loss": 0.5}
    got = metric_values(out)
    assert got == pytest.approx({"loss": 0.5, "rmse": 0.25, "n": 3.0, "mean": 1.5, "one": 1.0, "acc": float("nan")},
                                nan_ok=True)
    assert list(got)[0] == "loss" and all(type(v) is float for v in got.values())
    many = metric_values({**{f"m{i}": float(i) for i in range(40)}, "accuracy": 0.9, "loss": 1.0})
    assert len(many) == MAX_EVAL_METRICS and many["loss"] == 1.0 and many["accuracy"] == 0.9  # kept first


def test_a_bfloat16_number_is_a_real_number():
    from clients.protocol import real_number

    assert real_number(torch.tensor(1.5, dtype=torch.bfloat16)) == 1.5  # (numpy has no bfloat16)
    assert real_number(torch.tensor([2.0], dtype=torch.float16)) == 2.0 and real_number(torch.tensor(True)) is None
