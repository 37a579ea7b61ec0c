"""Client data sources: an .npz file (validated, never unpickled) or a task partition."""

from __future__ import annotations


import numpy as np
import pytest

import clients.data as data_mod
from clients import ClientError, TaskSpec
from clients.data import client_data, load_npz, save_npz
from clients.tasks import Dataset, DigitsTask


@pytest.fixture(scope="module")
def task():
    return DigitsTask(TaskSpec(partitioning="iid"))


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(data_mod, "_CACHE", {})


def _small(n=5, dim=64) -> Dataset:
    rng = np.random.default_rng(0)
    return Dataset(rng.random((n, dim)).astype(np.float32), (np.arange(n) % 10).astype(np.int64))


def test_save_and_load_round_trip(tmp_path):
    d = _small()
    save_npz(tmp_path / "d.npz", d)
    out = load_npz(tmp_path / "d.npz")
    assert np.array_equal(out.x, d.x) and np.array_equal(out.y, d.y)
    assert out.x.dtype == d.x.dtype


def test_missing_file(tmp_path):
    p = tmp_path / "nope.npz"
    with pytest.raises(ClientError, match="must be an existing .npz file") as info:
        load_npz(p)
    assert str(p) in str(info.value) and "no such file" in str(info.value)


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(ClientError, match="must be an existing .npz file"):
        load_npz(tmp_path)


def test_missing_keys_names_what_is_needed_and_found(tmp_path):
    p = tmp_path / "k.npz"
    np.savez(p, features=np.zeros((2, 64)), labels=np.zeros(2))
    with pytest.raises(ClientError) as info:
        load_npz(p)
    msg = str(info.value)
    assert "must hold arrays 'x' and 'y'" in msg
    assert "['features', 'labels']" in msg and str(p) in msg


def test_only_x_is_missing_y(tmp_path):
    p = tmp_path / "k.npz"
    np.savez(p, x=np.zeros((2, 64)))
    with pytest.raises(ClientError, match="must hold arrays 'x' and 'y'"):
        load_npz(p)


def test_missing_keys_message_does_not_claim_the_file_is_unreadable(tmp_path):
    p = tmp_path / "k.npz"
    np.savez(p, a=np.zeros(2))
    with pytest.raises(ClientError) as info:
        load_npz(p)
    assert str(info.value).startswith("data file must hold arrays 'x' and 'y'")


def test_text_file_is_not_an_npz(tmp_path):
    p = tmp_path / "t.npz"
    p.write_text("x,y\n1,2\n")
    with pytest.raises(ClientError, match="must be a readable .npz") as info:
        load_npz(p)
    assert str(p) in str(info.value)


def test_pickled_object_arrays_are_refused(tmp_path):
    p = tmp_path / "o.npz"
    np.savez(p, x=np.array([{"a": 1}, None], dtype=object), y=np.zeros(2, np.int64))
    with pytest.raises(ClientError, match="must be a readable .npz"):
        load_npz(p)


@pytest.mark.parametrize(("content", "what"), [(b"x,y\n1,2\n", "not a zip archive"), (b"", "empty"),
                                               (b"\x93NUMPY\x01\x00", "a single .npy array")])
def test_the_reason_a_file_is_not_an_npz_is_named(tmp_path, content, what):
    p = tmp_path / "d.npz"
    p.write_bytes(content)
    with pytest.raises(ClientError, match="must be a readable .npz") as info:
        load_npz(p)
    assert str(info.value).endswith(f"{p}: {what}.")


@pytest.mark.parametrize("kind", ["npy", "empty", "corrupt zip"])
def test_other_non_npz_files_raise_client_error(tmp_path, kind):
    p = tmp_path / "bad.npz"
    if kind == "npy":
        with open(p, "wb") as fh:
            np.save(fh, np.zeros(3))
    elif kind == "empty":
        p.write_bytes(b"")
    else:
        p.write_bytes(b"PK\x03\x04" + b"\x00" * 40)
    with pytest.raises(ClientError, match="must be a readable .npz|must be an .npz archive"):
        load_npz(p)


# --------------------------------------------------------------------------- client_data


def test_data_path_wins_over_partition(tmp_path, task):
    d = _small(7)
    save_npz(tmp_path / "mine.npz", d)
    out = client_data(task, {"data-path": str(tmp_path / "mine.npz"), "partition-id": 0, "num-partitions": 2})
    assert len(out) == 7
    assert np.array_equal(out.x, d.x) and out.y.dtype == np.int64


def test_data_path_is_checked_against_the_task(tmp_path, task):
    save_npz(tmp_path / "wrong.npz", _small(5, dim=10))
    with pytest.raises(ClientError, match=r"wrong\.npz: x must have shape \(n, 64\)"):
        client_data(task, {"data-path": str(tmp_path / "wrong.npz")})


def test_missing_data_path_file(tmp_path, task):
    with pytest.raises(ClientError, match="no such file"):
        client_data(task, {"data-path": str(tmp_path / "gone.npz")})


def test_partition_is_used_without_data_path(task):
    out = client_data(task, {"partition-id": 1, "num-partitions": 3})
    ref = task.partition(1, 3)
    assert np.array_equal(out.x, ref.x) and np.array_equal(out.y, ref.y)


def test_partition_keys_may_be_strings_of_ints(task):
    out = client_data(task, {"partition-id": "2", "num-partitions": "3"})
    assert np.array_equal(out.y, task.partition(2, 3).y)


@pytest.mark.parametrize(
    "node_config",
    [{}, {"partition-id": 0}, {"num-partitions": 2}, {"partition-id": "a", "num-partitions": 2},
     {"partition-id": None, "num-partitions": 2}],
)
def test_missing_both_sources_raises(node_config):
    with pytest.raises(ClientError, match="node config must give data-path, or partition-id and num-partitions"):
        client_data(DigitsTask(TaskSpec()), node_config)


def test_partition_id_out_of_range_raises(task):
    with pytest.raises(ClientError, match="partition-id must be in"):
        client_data(task, {"partition-id": 3, "num-partitions": 3})


def test_an_array_declaring_more_than_its_file_holds_is_refused_before_numpy_allocates_it(tmp_path):
    """A corrupt or hostile header (10^13 x 64 float32: 2.3 PiB) made numpy allocate first: MemoryError."""
    import io
    import zipfile

    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": (10**13, 64)})
    y = io.BytesIO()
    np.save(y, np.zeros(3, np.int64))
    with zipfile.ZipFile(tmp_path / "bomb.npz", "w") as z:
        z.writestr("x.npy", head.getvalue() + b"\0" * 100)
        z.writestr("y.npy", y.getvalue())
    with pytest.raises(ClientError, match=r"'x' declares shape \(10000000000000, 64\) \(2560000000000000 bytes\)"):
        load_npz(tmp_path / "bomb.npz")
    save_npz(tmp_path / "ok.npz", _small())  # a real file (compressed or not) passes the same check
    assert len(load_npz(tmp_path / "ok.npz")) == 5



def test_an_npz_whose_members_lack_the_npy_suffix_is_one_client_error(tmp_path):
    """numpy lists a member stored as plain 'x' as key 'x'; the size check then raised a bare KeyError, a
    traceback from `fedshield agent start --data` (review helper-59)."""
    import io
    import zipfile

    path = tmp_path / "noext.npz"
    with zipfile.ZipFile(path, "w") as zf:
        for name, arr in (("x", _small().x), ("y", _small().y)):
            buf = io.BytesIO()
            np.save(buf, arr)
            zf.writestr(name, buf.getvalue())
    with pytest.raises(ClientError, match=r"must store its arrays as members x\.npy .* Found members \['x', 'y'\]"):
        load_npz(path)


def test_a_partition_exported_from_another_split_is_refused_by_the_run(tmp_path):
    """`fedshield data export --seed 1` for a run of data-seed 0: 292 of the run's 360 test examples were in the
    exported training files, and nothing said so (review helper-59). Exports record the split they came from."""
    from clients.cli import export_partitions

    (path,) = export_partitions("digits", 1, str(tmp_path / "s1"), seed=1)
    test_rows = {row.tobytes() for row in DigitsTask(TaskSpec(data_seed=0)).test_set.x}
    with np.load(path) as npz:
        leaked = sum(row.tobytes() in test_rows for row in npz["x"])
    assert leaked > len(test_rows) / 2, leaked  # most of a data-seed 0 run's test examples (README's figure)
    with pytest.raises(ClientError, match=r"exported from another split of the task \(data-seed 1 there, 0 in this run\)"):
        client_data(DigitsTask(TaskSpec(data_seed=0)), {"data-path": str(path)})
    assert len(client_data(DigitsTask(TaskSpec(data_seed=1)), {"data-path": str(path)})) > 0
    own = tmp_path / "own.npz"  # the owner's own data records no split: taken as it is
    save_npz(own, Dataset(np.zeros((3, 64), np.float32), np.array([0, 1, 2])))
    assert len(client_data(DigitsTask(TaskSpec(data_seed=0)), {"data-path": str(own)})) == 3


def test_a_task_file_exported_under_another_path_spelling_is_the_same_split(tmp_path):
    """`data export --task flaky.py:Flaky` recorded the relative spelling; the run resolves the same file to an
    absolute path (and a device keeps it elsewhere): every round was refused as 'another split'."""
    from clients.data import check_split

    path = tmp_path / "p.npz"
    save_npz(path, Dataset(np.zeros((3, 64), np.float32), np.array([0, 1, 2])), TaskSpec(task="flaky.py:Flaky"))
    check_split(path, TaskSpec(task="/elsewhere/flaky.py:Flaky"))
    with pytest.raises(ClientError, match="another split of the task"):
        check_split(path, TaskSpec(task="/elsewhere/flaky.py:Other"))


def test_a_split_record_that_is_not_one_value_is_one_client_error(tmp_path):
    """The owner's file: a split_ record of several values made .item() raise past the ClientApp's refusals."""
    path = tmp_path / "odd.npz"
    np.savez(path, x=np.zeros((3, 64), np.float32), y=np.array([0, 1, 2]), split_data_seed=np.array([0, 1]))
    with pytest.raises(ClientError, match=r"must record its split .* as single values"):
        client_data(DigitsTask(TaskSpec()), {"data-path": str(path)})
