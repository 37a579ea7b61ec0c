"""RunDirectory on a file system that is not as expected: one CoordinatorError naming the path."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator import CoordinatorError, RunDirectory
from coordinator.rundir import CHECKPOINT, is_simulated, time_axis, time_label


def _row(rnd: int, **changes) -> dict:
    """A history row with what the plots, the summary and a resume read."""
    return {"round": rnd, "test_accuracy": 0.5, "test_loss": 1.0, "round_time_s": 1.0, "bytes_down": 10, "bytes_up": 10,
            **changes}


def test_checkpoint_round_trip(tmp_path):
    rd = RunDirectory(tmp_path / "run")
    assert rd.load_checkpoint() is None
    full = {"round": 2, "version": 2, "weights": torch.ones(3), "history": [_row(1), _row(2)], "optimizer": {},
            "rejections": {}, "fingerprint": {}}
    rd.save_checkpoint(full)
    state = rd.load_checkpoint()
    assert state["round"] == 2 and torch.equal(state["weights"], torch.ones(3))


@pytest.mark.parametrize("key, bad", [("fingerprint", None), ("optimizer", None), ("weights", "abc"),
                                      ("weights", torch.ones(2, 2)), ("history", 5), ("history", [1, 2]),
                                      ("version", "1"), ("rejections", [])])
def test_a_checkpoint_that_loads_but_is_incomplete_is_one_error(tmp_path, key, bad):
    """Only the round number used to be checked: resuming then failed with KeyError / AttributeError
    (or, with history rows that are not dicts, in the CLI's "already holds N rounds" path)."""
    from coordinator import CoordinatorError

    state = {"round": 2, "version": 2, "weights": torch.ones(3), "history": [], "optimizer": {}, "rejections": {},
             "fingerprint": {}}
    if bad is None:
        del state[key]
    else:
        state[key] = bad
    rd = RunDirectory(tmp_path / "run")
    rd.save_checkpoint(state)
    with pytest.raises(CoordinatorError, match=rf"is not a complete fedshield checkpoint \('{key}' is missing or not"):
        rd.load_checkpoint()


def _state(**changes):
    state = {"round": 2, "version": 2, "weights": torch.ones(3), "history": [_row(1), _row(2)],
             "optimizer": {}, "rejections": {"bad-array": 1}, "fingerprint": {"numel": 3}}
    return {**state, **changes}


@pytest.mark.parametrize("changes, problem", [
    ({"weights": torch.tensor([1.0, float("nan"), 1.0])}, "its weights hold NaN or infinity"),
    ({"weights": torch.ones(100)}, "100 weights for a model of 3"),
    ({"round": -5, "history": []}, "round -5 and version 2 must be >= 0"),
    ({"round": 1}, r"every history row must name a round in \[1, 1\]"),
    ({"history": [{"foo": 1}]}, r"every history row must name a round in \[1, 2\]"),
    ({"rejections": {"x": "y"}}, "rejection counts must be integers >= 0"),
    ({"extra": [1]}, "'extra' must be a dict"),
    ({"privacy": "spent"}, "'privacy' must be a dict"),
    # a review (helper-50): each of these resumed, then failed after training a round, or reported wrong results
    ({"history": [_row(1), _row(1), _row(2)]}, r"the history's rounds must increase row by row \(no round twice\)"),
    ({"history": [_row(1), {"round": 2}]}, "round 2's test_accuracy must be a number. Found 'None'"),
    ({"history": [_row(1), _row(2, bytes_down="x")]}, "round 2's bytes_down must be a number. Found 'x'"),
    ({"rejections": {1: 2, "a": 3}}, "rejection counts must be keyed by rule names"),
    ({"history": [_row(1), _row(2, test_metrics=[1.0])]},
     r"round 2's test_metrics must map names to numbers. Found '\[1.0\]'"),
    ({"history": [_row(1, fed_eval_metrics={"rmse": "x"}), _row(2)]},
     "round 1's fed_eval_metrics must map names to numbers. Found \"{'rmse': 'x'}\""),
])
def test_a_checkpoint_whose_parts_disagree_is_one_error(tmp_path, changes, problem):
    """Each of these loaded and then ended in a traceback, or ran on silently (NaN weights: every reply refused)."""
    rd = RunDirectory(tmp_path / "run")
    rd.save_checkpoint(_state(**changes))
    with pytest.raises(CoordinatorError, match=rf"is not a consistent fedshield checkpoint \({problem}\)"):
        rd.load_checkpoint()


def test_a_checkpoint_changed_after_it_was_written_is_refused(tmp_path):
    rd = RunDirectory(tmp_path / "run")
    rd.save_checkpoint(_state())
    state = torch.load(rd.file(CHECKPOINT), weights_only=True)
    state["weights"][1] = 1.0000001  # one flipped low bit loaded silently
    torch.save(state, rd.file(CHECKPOINT))
    with pytest.raises(CoordinatorError, match="weights do not match their SHA-256"):
        rd.load_checkpoint()
    del state["weights-sha256"]  # a checkpoint of an earlier fedshield: no digest to check
    torch.save(state, rd.file(CHECKPOINT))
    assert rd.load_checkpoint()["round"] == 2


def test_results_without_a_checkpoint_are_not_overwritten(tmp_path):
    from coordinator.rundir import check_run_dir

    (tmp_path / "metrics.csv").write_text("precious\n")
    with pytest.raises(CoordinatorError, match=r"holds results \(metrics.csv\) but no checkpoint.pt to resume from"):
        check_run_dir(tmp_path)
    assert check_run_dir(tmp_path / "new") == (0, None)


def test_a_truncated_checkpoint_is_called_corrupted_not_unreadable(tmp_path):
    rd = RunDirectory(tmp_path / "run")
    rd.save_checkpoint(_state(weights=torch.ones(50_000)))
    data = rd.file(CHECKPOINT).read_bytes()
    for cut in (len(data) // 2, len(data) - 10, 100):
        rd.file(CHECKPOINT).write_bytes(data[:cut])
        with pytest.raises(CoordinatorError, match="is not a fedshield checkpoint"):
            rd.load_checkpoint()


@pytest.mark.parametrize("content", [b"junk\n", b"", b"\x80\x02}q\x00.", b"PK\x03\x04garbage"])
def test_corrupt_checkpoint_is_one_clear_error(tmp_path, content):
    (tmp_path / CHECKPOINT).write_bytes(content)
    with pytest.raises(CoordinatorError, match=r"checkpoint\.pt is not a fedshield checkpoint \(.*\); move it away "
                                               r"or pick another --run-dir\.") as info:
        RunDirectory(tmp_path).load_checkpoint()
    assert str(tmp_path / CHECKPOINT) in str(info.value) and "\n" not in str(info.value)


def test_a_torch_file_that_is_not_a_checkpoint(tmp_path):
    torch.save(torch.zeros(2), tmp_path / CHECKPOINT)
    with pytest.raises(CoordinatorError, match="is not a fedshield checkpoint .no round number"):
        RunDirectory(tmp_path).load_checkpoint()


def test_run_directory_that_is_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(CoordinatorError, match="run directory must be a directory. Found a file at .*afile; pick another"):
        RunDirectory(f)


WALL = [{"round": 1, "round_time_s": 1.5}, {"round": 2, "round_time_s": 2.0}]
SIMULATED = [{"round": 1, "round_time_s": 3.0, "sim_time_s": 3.0}, {"round": 2, "round_time_s": 4.0, "sim_time_s": 7.0}]


def test_time_label_says_what_the_time_axis_measures():
    assert time_axis(WALL) == [1.5, 3.5] and time_axis(SIMULATED) == [3.0, 7.0]
    assert not is_simulated(WALL) and is_simulated(SIMULATED) and not is_simulated([])
    assert time_label([WALL]) == "rounds' wall time summed"
    assert time_label([SIMULATED, SIMULATED]) == "simulated on the virtual engine"
    assert "simulated" in time_label([WALL, SIMULATED]) and "wall time" in time_label([WALL, SIMULATED])


def test_plots_draw_titles_and_labels_as_given(tmp_path):
    """A '$' in a run directory's or scenario's name was read as mathtext (a parse error after the run had
    trained, and again at every resume); a path's undecodable byte was a TypeError in the font code."""
    rd = RunDirectory(tmp_path / "run")
    rows = [{"round": 1, "test_accuracy": 0.5, "test_loss": 1.0, "epsilon": 1.0, "round_time_s": 1.0}]
    rd.plot(rows, "rd_$_$ \udcff")
    rd.plot_epsilon(rows, "a$_$")
    rd.plot_accuracy_vs_time({"rd_$_$ \udcff": rows}, "b$")
    assert all((tmp_path / "run" / name).stat().st_size > 0
               for name in ("accuracy.png", "epsilon.png", "accuracy_vs_time.png"))


def test_plots_show_a_tasks_own_metric_where_it_has_no_accuracy():
    from coordinator.rundir import headline_metric, metric_series

    nan = float("nan")
    reg = [{"round": 1, "test_accuracy": nan, "test_metrics": {"rmse": 2.0}}, {"round": 2, "test_accuracy": nan},
           {"round": 3, "test_accuracy": nan, "test_metrics": {"rmse": 1.5, "mae": 1.0}}]
    assert headline_metric(reg) == "rmse" and metric_series(reg, "rmse")[::2] == [2.0, 1.5]
    assert math.isnan(metric_series(reg, "rmse")[1])  # a round not evaluated (central-eval-every)
    cls = [{"round": 1, "test_accuracy": nan, "test_metrics": {"f1": 0.3}}, {"round": 2, "test_accuracy": 0.8}]
    assert headline_metric(cls) == "accuracy" and headline_metric([]) == "accuracy"


def test_check_run_dir_names_a_link_to_nowhere(tmp_path):
    from coordinator import CoordinatorError
    from coordinator.rundir import check_run_dir

    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(CoordinatorError, match="a link to .*gone, which does not exist"):
        check_run_dir(tmp_path / "link" / "run")
    assert check_run_dir(tmp_path / "new" / "run") == (0, None) and sorted(tmp_path.iterdir()) == [tmp_path / "link"]


def test_float16_weights_are_refused_not_resumed_for_every_client_to_refuse(tmp_path):
    rd = RunDirectory(tmp_path / "run")
    rd.save_checkpoint(_state(weights=torch.ones(3, dtype=torch.float16)))
    with pytest.raises(CoordinatorError, match=r"is not a complete fedshield checkpoint \('weights' is missing or not"):
        rd.load_checkpoint()


def test_a_compressed_checkpoint_is_refused_before_it_is_inflated(tmp_path):
    """torch.save stores its entries: a deflated 500M-zero checkpoint (2 MB) took 5.7 GB before its size was
    checked."""
    import zipfile

    rd = RunDirectory(tmp_path / "run")
    rd.save_checkpoint(_state())
    path = rd.file(CHECKPOINT)
    with zipfile.ZipFile(path) as src:
        entries = [(info, src.read(info)) for info in src.infolist()]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info, data in entries:
            dst.writestr(info.filename, data)
    with pytest.raises(CoordinatorError, match=r"is not a fedshield checkpoint \(entry .* is compressed, as torch.save "
                                               "never writes"):
        rd.load_checkpoint()


def test_a_plain_pickle_is_refused_without_torch_s_warning(tmp_path, recwarn):
    import pickle

    rd = RunDirectory(tmp_path / "run")
    rd.file(CHECKPOINT).write_bytes(pickle.dumps({"round": 1}, protocol=4))
    with pytest.raises(CoordinatorError, match="is not a fedshield checkpoint"):
        rd.load_checkpoint()
    assert not [w for w in recwarn if "pickle" in str(w.message)]


def test_a_run_dir_is_held_by_one_process_at_a_time(tmp_path):
    """Two runs in one directory resumed each other's checkpoints and mixed their results (a review)."""
    import subprocess
    import sys

    from coordinator.rundir import LOCK, lock_run_dir

    run = tmp_path / "run"
    (run).mkdir()
    (run / ".checkpoint.pt.0123456789abcdef.tmp").write_bytes(b"half")  # a write killed midway
    (run / ".vimrc.tmp").write_text("not ours")  # (--run-dir . or ~: only this run's temporary files go)
    (run / ".session.tmp").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from coordinator.rundir import lock_run_dir; "
                               f"lock_run_dir({str(run)!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert not (run / ".checkpoint.pt.0123456789abcdef.tmp").exists()  # cleared by the run that holds it
        assert (run / ".vimrc.tmp").read_text() == "not ours" and (run / ".session.tmp").is_dir()
        with pytest.raises(CoordinatorError, match=rf"--run-dir {run} must not be in use by another run. Found it held "
                                                   rf"by process {holder.pid}; "):
            lock_run_dir(run)
    finally:
        holder.kill()
        holder.wait()
    lock_run_dir(run)  # free again (the holder's lock went with it)
    lock_run_dir(run)  # this process holds it already: fine
    assert (run / LOCK).read_text().strip() == str(__import__("os").getpid())


def test_a_file_system_that_cannot_lock_is_said_so_not_blamed_on_a_stale_pid(tmp_path, monkeypatch):
    import errno
    import fcntl

    from coordinator.rundir import LOCK, lock_run_dir

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK).write_text("4242\n")  # an earlier holder's pid

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(CoordinatorError, match=r"must be on a file system that can lock files. Found: No locks available"):
        lock_run_dir(tmp_path / "run")


def test_a_lock_a_holder_lets_go_of_within_the_wait_is_taken_and_the_wait_said_once(tmp_path):
    """A coordinator restarted a moment after a killed one waits for its ServerApp to let go, and says so once."""
    import subprocess
    import sys

    from coordinator.rundir import lock_run_dir, unlock_run_dir

    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import time; from coordinator.rundir import lock_run_dir; "
                               f"lock_run_dir({str(run)!r}); print('held', flush=True); time.sleep(1.0)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        waits: list[str] = []
        assert lock_run_dir(run, wait=30, on_wait=waits.append) is True
        assert waits == [str(holder.pid)]
    finally:
        holder.kill()
        holder.wait()
    unlock_run_dir(run, remove=True)


def test_a_finished_run_removes_its_lock_file_and_a_waiting_run_locks_the_new_one(tmp_path):
    """A finished run left .fedshield.lock behind (a new user's trip). The holder removes it while it still holds
    it; a process that opened the old file meanwhile and then gets its lock must not run beside a third one that
    made a new file: it sees the file is gone and locks the one there now."""
    import subprocess
    import sys

    from coordinator.rundir import LOCK, lock_run_dir, unlock_run_dir

    run = tmp_path / "run"
    assert lock_run_dir(run) is True and lock_run_dir(run) is False  # taken now; already held
    waiter = subprocess.Popen([sys.executable, "-c", "import os, sys; from coordinator.rundir import lock_run_dir; "
                               f"lock_run_dir({str(run)!r}, wait=30); print(os.stat({str(run / LOCK)!r}).st_ino, "
                               "flush=True)"], stdout=subprocess.PIPE, text=True)
    try:
        import time

        time.sleep(1.0)  # the waiter has opened the old file and polls its lock
        unlock_run_dir(run, remove=True)
        assert waiter.stdout.readline().strip().isdigit()  # it locked the file that is there now
        assert waiter.wait(30) == 0
    finally:
        waiter.kill()
    lock_run_dir(run)
    unlock_run_dir(run, remove=True)
    assert not (run / LOCK).exists()


def test_a_finished_run_is_one_whose_summary_is_its_checkpoints(tmp_path):
    """finished_summary: the rule coordinator start, simulate and run_scenario share for "nothing left to train"."""
    import json

    from coordinator.rundir import SUMMARY, finished_summary

    assert finished_summary(tmp_path, 5, 5) is None  # no summary yet: the run resumes to write it
    (tmp_path / SUMMARY).write_text("{not json")
    assert finished_summary(tmp_path, 5, 5) is None
    (tmp_path / SUMMARY).write_text(json.dumps({"rounds": 3, "final_test_accuracy": 0.5}))
    assert finished_summary(tmp_path, 5, 5) is None  # stopped after round 5's checkpoint, before its summary
    (tmp_path / SUMMARY).write_text(json.dumps({"rounds": 5, "final_test_accuracy": 0.5}))
    assert finished_summary(tmp_path, 5, 6) is None and finished_summary(tmp_path, 5, 4)["rounds"] == 5
