"""The device's local-DP ledger on disk, and its owner's limits on local DP (clients.ledger)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from aggregation import tensor_to_array
from clients import ClientError, TaskSpec, TrainInstruction, TrainSettings
from clients.client_app import run_train
from clients.ledger import PREFIX, ledger_key
from clients.protocol import ARRAYS, CONFIG, LOCAL_DP, MESSAGE_TYPE_TRAIN, WEIGHTS
from clients.tasks import get_task

TASK = TaskSpec(task="synthetic", partitioning="iid", data_seed=4)
NODE = {"partition-id": 0, "num-partitions": 40}


def _message(rnd: int, z: float | None = 1.0, epochs: int = 1, data_seed: int = TASK.data_seed) -> Message:
    instr = TrainInstruction(round=rnd, version=rnd - 1, seed=11, task=dataclasses.replace(TASK, data_seed=data_seed),
                             train=TrainSettings(local_epochs=epochs, batch_size=16, lr=0.1, momentum=0.0))
    numel = sum(p.numel() for p in get_task(TASK).build_model().parameters())
    content = RecordDict({CONFIG: instr.to_record(), ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(torch.zeros(numel))})})
    if z is not None:
        content[LOCAL_DP] = ConfigRecord({"noise-multiplier": z, "max-grad-norm": 1.0, "delta": 1e-5})
    return Message(content, dst_node_id=1001, message_type=MESSAGE_TYPE_TRAIN)


def _context(**node) -> Context:
    return Context(run_id=1, node_id=1001, node_config={**NODE, **node}, state=RecordDict(), run_config={})


def _epsilon(reply: Message) -> float:
    return float(reply.content.metric_records["metrics"]["local-epsilon"])


def test_the_ledger_outlives_the_run_so_epsilon_goes_on_after_a_restart(tmp_path):
    """A resumed coordinator (a new Flower run) or a restarted agent gave the node a fresh Context,
    and local-epsilon started again from its first-round value on the same data."""
    first = _context(**{"state-dir": str(tmp_path)})
    eps = [_epsilon(run_train(_message(1), first))]
    (path,) = tmp_path.glob(f"{PREFIX}*.json")
    steps = _steps(path)
    eps.append(_epsilon(run_train(_message(2), first)))
    fresh = _context(**{"state-dir": str(tmp_path)})  # a new run: nothing in its Context.state
    eps.append(_epsilon(run_train(_message(3), fresh)))
    assert eps[0] < eps[1] < eps[2]
    assert list(tmp_path.glob(f"{PREFIX}*.json")) == [path] and _steps(path) == 3 * steps
    # without a state dir (a simulation), the ledger lives in the Context only: a fresh one starts again
    assert _epsilon(run_train(_message(1), _context())) == pytest.approx(eps[0], rel=1e-9)


def _steps(path) -> int:
    """DP-SGD steps a ledger file holds (the accountant merges like events into one)."""
    return sum(int(e[2]) for e in json.loads(path.read_text())["history"])


def test_the_ledger_is_keyed_by_the_data_not_the_node():
    """A data file's ledger by its contents; a built-in partition's by its task: which examples a partition holds
    follows the coordinator's data-seed, partitioning and dirichlet-alpha, and keyed by the examples, a coordinator
    changing them gave an overlapping partition a fresh ledger, past the owner's --max-local-epsilon (a review)."""
    data, other = get_task(TASK).partition(0, 40), get_task(TASK).partition(1, 40)
    files = {"data-path": "a.npz"}
    assert ledger_key(TASK.task, data, files) == ledger_key("digits", data, {"data-path": "b.npz"})
    assert ledger_key(TASK.task, data, files) != ledger_key(TASK.task, other, files)
    parts = {"partition-id": 0, "num-partitions": 40}
    assert ledger_key(TASK.task, data, parts) == ledger_key(TASK.task, other, {**parts, "partition-id": 1})
    assert ledger_key(TASK.task, data, parts) != ledger_key("digits", data, parts)


def test_a_task_file_s_partition_has_a_ledger_named_by_its_file_wherever_it_lies(tmp_path):
    """A task named by its file (``dir/mytask.py:Cnn``): its path's slashes made a lock no one could create, and
    every local-DP round of a --partition device was refused (found by a newcomer's walkthrough)."""
    from clients.ledger import LedgerFile

    data = get_task(TASK).partition(0, 40)
    here, there = ledger_key("/tmp/a/my task.py:Cnn", data, NODE), ledger_key("b/my task.py:Cnn", data, NODE)
    assert here == there == "task-my_task.py:Cnn"
    assert ledger_key("mypkg.tasks:Cnn", data, NODE) == "task-mypkg.tasks:Cnn"  # as before
    assert ledger_key("digits", data, NODE) == "task-digits"
    assert ledger_key("/tmp/a/my task.py:Other", data, NODE) != here
    ledger = LedgerFile(tmp_path, here)
    with ledger.locked():
        pass
    assert ledger.path.parent == tmp_path and (tmp_path / f"{PREFIX}{here}.lock").exists()


def test_a_coordinator_cannot_reset_a_partition_s_ledger_by_moving_its_examples(tmp_path):
    """Other data-seeds give overlapping partitions: all are charged to one ledger, so the owner's bound holds."""
    eps = []
    for seed in (0, 1, 2):
        ctx = _context(**{"state-dir": str(tmp_path)})
        eps.append(_epsilon(run_train(_message(1, data_seed=seed), ctx)))
    assert eps[0] < eps[1] < eps[2] and len(list(tmp_path.glob(f"{PREFIX}*.json"))) == 1


def test_an_unreadable_ledger_refuses_training_instead_of_starting_afresh(tmp_path):
    ctx = _context(**{"state-dir": str(tmp_path)})
    run_train(_message(1), ctx)
    (path,) = tmp_path.glob(f"{PREFIX}*.json")
    # a sample rate > 1; deep nesting; a noise multiplier whose square underflows (opacus divided by it: ZeroDivisionError)
    for bad in ('{"mechanism": "rdp", "history": [[1.0, 2.0, 3]]}', "[" * 200_000,
                '{"mechanism": "rdp", "history": [[1e-300, 1.0, 1]]}'):
        path.write_text(bad)
        with pytest.raises(ClientError, match="local DP ledger .* must be readable"):
            run_train(_message(2), _context(**{"state-dir": str(tmp_path)}))


@pytest.mark.parametrize(("z", "found"), [(None, "no local DP"), (0.5, "noise multiplier 0.5")])
def test_the_owner_s_min_local_noise_refuses_less_from_the_coordinator(z, found):
    with pytest.raises(ClientError, match=f"noise multiplier >= 1 .*min-local-noise.*Found {found}"):
        run_train(_message(1, z=z), _context(**{"min-local-noise": 1.0}))
    assert _epsilon(run_train(_message(1, z=1.0), _context(**{"min-local-noise": 1.0}))) > 0


def test_the_clientapp_answers_a_refusal_with_an_error_reply_not_a_traceback(caplog):
    """Raised, Flower logged a traceback in the node's log every round and the coordinator read
    ``<class 'clients._errors.ClientError'>`` before the reason (README walkthrough)."""
    from clients.client_app import train

    msg = _message(1, z=0.5)
    with caplog.at_level("WARNING", logger="flwr"):
        reply = train(msg, _context(**{"min-local-noise": 1.0}))
    assert reply.has_error() and reply.metadata.reply_to_message_id == msg.metadata.message_id
    assert reply.error.reason.startswith("refused by the node: ")
    assert "min-local-noise" in reply.error.reason and "ClientError" not in reply.error.reason
    assert "node refused a message" in caplog.text and "Traceback" not in caplog.text
    assert not train(_message(1, z=1.0), _context(**{"min-local-noise": 1.0})).has_error()


def test_the_owner_s_max_local_epsilon_refuses_a_round_without_local_dp(tmp_path):
    """A coordinator that leaves the local-DP record out would get the raw update (epsilon unbounded)."""
    ctx = _context(**{"state-dir": str(tmp_path), "max-local-epsilon": 1e9})
    with pytest.raises(ClientError, match="only under local DP .*--max-local-epsilon 1e\\+09.*Found no local DP"):
        run_train(_message(1, z=None), ctx)
    assert _epsilon(run_train(_message(1), ctx)) > 0
    assert run_train(_message(1, z=None), _context()).content.array_records  # no limits: trains without DP


def test_the_owner_s_max_local_epsilon_needs_a_state_dir():
    """Without a state-dir (a plain SuperNode, Flower's simulation engine) the ledger lived in the run's Context:
    every new run trained from epsilon 0 again (4 runs of 4.5 each under a bound of 5 in the repro)."""
    with pytest.raises(ClientError, match="limits its local epsilon to 5 .*needs a state-dir in its node config"):
        run_train(_message(1), _context(**{"max-local-epsilon": 5.0}))
    assert _epsilon(run_train(_message(1), _context(**{"min-local-noise": 1.0}))) > 0  # a per-round limit: no ledger


def test_the_owner_s_max_local_epsilon_refuses_a_round_before_it_trains(tmp_path, monkeypatch):
    from clients import dp_training

    ctx = _context(**{"state-dir": str(tmp_path)})
    once = _epsilon(run_train(_message(1), ctx))
    twice = _epsilon(run_train(_message(2), ctx))
    limit = (twice + once) / 2
    trained = []
    real = dp_training.train_local_dp
    monkeypatch.setattr(dp_training, "train_local_dp", lambda *a, **k: trained.append(1) or real(*a, **k))
    fresh = _context(**{"state-dir": str(tmp_path / "fresh"), "max-local-epsilon": limit})
    (tmp_path / "fresh").mkdir()
    assert _epsilon(run_train(_message(1), fresh)) == pytest.approx(once, rel=1e-9)  # within the limit: trains
    with pytest.raises(ClientError, match=f"would bring this data's local epsilon to {twice:.4g}, past"):
        run_train(_message(2), fresh)
    assert trained == [1]  # refused before training (the planned epsilon is what training then reports)
    assert _steps(next((tmp_path / "fresh").glob(f"{PREFIX}*.json"))) == _steps(next(tmp_path.glob(f"{PREFIX}*.json"))) // 2


def test_the_owner_s_limits_hold_at_the_device_s_delta_and_with_poisson_sampling(tmp_path):
    """A coordinator's local-dp record with delta 0.5 and Poisson sampling off reported (and checked) a
    far smaller epsilon against --max-local-epsilon: under the owner's limits the device's own apply."""
    def lax(rnd):
        msg = _message(rnd)
        msg.content[LOCAL_DP] = ConfigRecord({"noise-multiplier": 1.0, "max-grad-norm": 1.0, "delta": 0.5,
                                              "poisson-sampling": False})
        return msg

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    honest = _epsilon(run_train(_message(1), _context(**{"state-dir": str(tmp_path / "a"), "max-local-epsilon": 1e9})))
    lax_eps = _epsilon(run_train(lax(1), _context(**{"state-dir": str(tmp_path / "b"), "max-local-epsilon": 1e9})))
    assert lax_eps == pytest.approx(honest, rel=1e-9)
    # without owner limits the coordinator's settings stand (and its report is its own business)
    assert _epsilon(run_train(lax(1), _context())) < honest / 2


def test_two_trainings_of_the_same_data_at_once_are_both_charged(tmp_path):
    import threading

    ctx = lambda: _context(**{"state-dir": str(tmp_path)})  # noqa: E731 - a fresh Context each: two runs
    run_train(_message(1), ctx())
    (path,) = tmp_path.glob(f"{PREFIX}*.json")
    one = _steps(path)
    threads = [threading.Thread(target=run_train, args=(_message(2), ctx())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert _steps(path) == 3 * one


def test_a_partition_s_ledger_from_before_task_keys_is_carried_over_not_reset(tmp_path):
    """Before, a built-in partition's ledger was keyed by its examples; the task-keyed ledger must start from it
    (a review found an upgrade reset every --partition node's epsilon to zero)."""
    from clients.ledger import data_key

    first = _context(**{"state-dir": str(tmp_path)})
    eps = _epsilon(run_train(_message(1), first))
    (path,) = tmp_path.glob(f"{PREFIX}*.json")
    data = get_task(TASK).partition(0, 40)
    path.rename(tmp_path / f"{PREFIX}{data_key(data)}.json")  # as the earlier version named it
    again = _epsilon(run_train(_message(2), _context(**{"state-dir": str(tmp_path)})))
    assert again > eps * 1.2
    assert (tmp_path / f"{PREFIX}task-{TASK.task}.json").is_file()


def test_every_content_keyed_ledger_is_carried_over_not_just_one(tmp_path):
    """Two partitions' ledgers from before task keys: the task ledger composes both (it may over-count, never
    under-count); taking one of them dropped the other's steps."""
    from clients.ledger import data_key

    steps = []
    for part, rounds in ((0, 1), (1, 2)):  # two content-keyed ledgers with different step counts
        (tmp_path / str(part)).mkdir()
        ctx = _context(**{"state-dir": str(tmp_path / str(part))})
        for rnd in range(1, rounds + 1):
            run_train(_message(rnd), ctx)
        (path,) = (tmp_path / str(part)).glob(f"{PREFIX}*.json")
        steps.append(_steps(path))
        path.rename(tmp_path / f"{PREFIX}{data_key(get_task(TASK).partition(part, 40))}.json")
    assert steps[1] == 2 * steps[0]  # (the same data size a round)
    run_train(_message(3), _context(**{"state-dir": str(tmp_path)}))
    assert _steps(tmp_path / f"{PREFIX}task-{TASK.task}.json") == steps[0] + steps[1] + steps[0]  # both, then this round's


def test_the_owner_s_limits_force_poisson_sampling_and_the_device_s_delta(monkeypatch, tmp_path):
    """The reported epsilon is the same either way, so capture what training is given."""
    from clients import dp_training
    from clients.ledger import OWNER_DELTA

    given = []
    real = dp_training.train_local_dp
    monkeypatch.setattr(dp_training, "train_local_dp", lambda *a, **k: given.append(a[3]) or real(*a, **k))
    msg = _message(1)
    msg.content[LOCAL_DP] = ConfigRecord({"noise-multiplier": 1.0, "max-grad-norm": 1.0, "delta": 0.5,
                                          "poisson-sampling": False})
    run_train(msg, _context(**{"state-dir": str(tmp_path), "max-local-epsilon": 1e9}))
    assert given[0].poisson_sampling is True and given[0].delta == OWNER_DELTA
