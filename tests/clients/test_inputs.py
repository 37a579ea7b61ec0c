"""Named inputs (``Dataset.x`` a dict of arrays, the forward's keyword arguments): token ids with a padding mask and
float side features, through the checks, the default loops, the batched engine, local DP's paths, a data file and
the agent's checks, and SecAgg+ with distributed DP."""

from __future__ import annotations

import argparse
import logging
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from clients import ClientError, Dataset, Task
from clients.data import load_npz, save_npz
from clients.dp_training import LocalDpSettings, train_local_dp, vmap_clipped_grad_sum
from clients.tasks.inputs import forward, take
from simulations import simulate


class _Pooled(nn.Module):
    """Token ids pooled over their mask, plus a float side feature: three inputs of three dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.side, self.out = nn.Embedding(20, 16), nn.Linear(2, 16), nn.Linear(16, 3)

    def forward(self, ids, mask, side):
        kept = mask.unsqueeze(-1).float()
        pooled = (self.emb(ids) * kept).sum(1) / kept.sum(1).clamp(min=1)
        return self.out(torch.relu(pooled + self.side(side)))


class Reviews(Task):
    """Three classes; the first token says the class, the side feature leans towards it."""

    num_classes = 3

    def build_model(self) -> nn.Module:
        return _Pooled()

    def load_data(self):
        rng = np.random.default_rng(self.spec.data_seed)
        n, length = 600, 8
        y = rng.integers(0, 3, n)
        ids = rng.integers(1, 20, (n, length)).astype(np.int32)
        ids[:, 0] = np.where(rng.random(n) < 0.7, y * 5 + 2, ids[:, 0])  # 70% carry the signal
        mask = np.arange(length)[None] < rng.integers(2, length + 1, n)[:, None]
        x = {"ids": np.where(mask, ids, 0), "mask": mask, "side": rng.normal(size=(n, 2)) + y[:, None] * 0.3}
        return Dataset(x, y).take(slice(0, 480)), Dataset(x, y).take(slice(480, None))


def _reviews(n=6):
    return Reviews.check_data(Reviews().train_set.take(slice(0, n)), "t")


def test_named_inputs_are_checked_and_cast_by_kind():
    data = Reviews().train_set
    assert data.x["ids"].dtype == np.int64 and data.x["mask"].dtype == np.bool_ and data.x["side"].dtype == np.float32
    x, y = dict(data.x), data.y
    with pytest.raises(ClientError, match="every input must hold the same number of examples. Found 'ids' 480, 'mask' 5."):
        Reviews.check_data(Dataset({**x, "mask": x["mask"][:5]}, y), "f.npz")
    with pytest.raises(ClientError, match=r"names must be identifiers .* Found 'my ids'"):
        Reviews.check_data(Dataset({"my ids": x["ids"]}, y), "f.npz")
    with pytest.raises(ClientError, match=r"f.npz: y must have shape \(480,\)"):
        Reviews.check_data(Dataset(x, y[:3]), "f.npz")
    with pytest.raises(ClientError, match="f.npz: side must be numeric"):
        Reviews.check_data(Dataset({**x, "side": x["side"].astype(str)}, y), "f.npz")

    class Shaped(Reviews):
        input_shape = {"ids": (8,), "mask": (8,), "side": (2,)}
        x_dtype = {"mask": "float32"}

    assert Shaped.check_data(data, "f").x["mask"].dtype == np.float32  # a dtype by name wins over the kind
    with pytest.raises(ClientError, match=r"f.npz: side must have shape \(n, 2\)"):
        Shaped.check_data(Dataset({**x, "side": x["side"][:, :1]}, y), "f.npz")
    with pytest.raises(ClientError, match=r"x must hold the inputs 'ids', 'mask', 'side' for task Shaped. Found 'ids'\."):
        Shaped.check_data(Dataset({"ids": x["ids"]}, y), "f.npz")

    class Misspelt(Reviews):
        x_dtype = {"msk": "float32"}  # (a new user's: the mask stayed bool, said nowhere)

    with pytest.raises(ClientError, match=r"f: x_dtype of task Misspelt must name only its inputs 'ids', 'mask', "
                                          r"'side'. Found 'msk'\."):
        Misspelt.check_data(data, "f")

    class Wrong(Reviews):
        input_shape = (8,)

    with pytest.raises(ClientError, match="named inputs need input_shape to be a dict of shapes by name"):
        Wrong.check_data(data, "f.npz")


def test_a_torch_dataset_of_dicts_becomes_named_inputs():
    class Tokenised(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"input_ids": torch.tensor([i, i + 1]), "attention_mask": torch.tensor([1, 0])}, i

    data = Dataset.from_torch(Tokenised())
    assert data.x["input_ids"].shape == (3, 2) and data.x["attention_mask"].tolist() == [[1, 0]] * 3
    assert data.y.tolist() == [0, 1, 2] and len(data.take([0, 2])) == 2


def test_named_inputs_train_the_same_batched_and_one_by_one_and_learn(tmp_path, caplog):
    """Learning band (both bounds; chance 0.33, 0.65 here) after 4 rounds; the batched engine (which trained them
    batched: it says when it does not) equals the one-by-one loop."""
    with caplog.at_level(logging.INFO):
        runs = [simulate(Reviews, run_dir=tmp_path / str(b), num_supernodes=4, num_rounds=4, local_epochs=2, lr=0.1,
                         batched=b) for b in (True, False)]
    assert not [r for r in caplog.records if "train one at a time" in r.getMessage()]
    assert all(s["rejected_total"] == 0 and s["rounds"] == 4 for s in runs)
    assert runs[0]["final_test_loss"] == pytest.approx(runs[1]["final_test_loss"], rel=1e-5)
    assert 0.5 <= runs[0]["final_test_accuracy"] <= 0.9, runs[0]["final_test_accuracy"]


def test_named_inputs_under_secagg_with_distributed_dp(tmp_path):
    s = simulate(Reviews, run_dir=tmp_path / "ddp", num_supernodes=5, min_nodes=5, num_rounds=2, lr=0.1,
                 secure_aggregation="secagg+", secagg_weighting="uniform", dp="distributed", dp_noise_multiplier=0.3,
                 dp_clip=1.0, secagg_clip=50.0)
    assert s["rounds"] == 2 and s["rejected_total"] == 0 and math.isfinite(s["final_test_loss"])


def _per_example(model, x, y, clip):
    """Each example's own backward (float64), clipped with Opacus's factor, summed."""
    model = model.double()
    params = [p for p in model.parameters() if p.requires_grad]
    sums = [torch.zeros_like(p) for p in params]
    for i in range(len(y)):
        xi = {k: v[i:i + 1].double() if v.is_floating_point() else v[i:i + 1] for k, v in x.items()}
        grads = torch.autograd.grad(nn.functional.cross_entropy(forward(model, xi), y[i:i + 1]), params)
        norm = torch.sqrt(sum(g.square().sum() for g in grads)).item()
        for total, g in zip(sums, grads, strict=True):
            total.add_(g, alpha=min(1.0, clip / (norm + 1e-6)))
    model.float()
    return sums


def test_local_dp_clips_each_example_of_named_inputs_on_every_path():
    """vmap's per-example sums equal a loop's and Opacus's hooks'; train_local_dp runs both paths."""
    torch.manual_seed(0)
    data = _reviews(10)
    x = {k: torch.from_numpy(v) for k, v in data.x.items()}
    y = torch.from_numpy(data.y)
    model = _Pooled()
    sums, loss, norms = vmap_clipped_grad_sum(model, x, y, 0.5, chunk=4)
    assert int((norms > 0.5).sum()) >= 3
    assert loss.item() == pytest.approx(nn.functional.cross_entropy(forward(model, x), y).item(), rel=1e-5)
    for got, ref in zip(sums, _per_example(model, x, y, 0.5), strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-6)
    from opacus import GradSampleModule

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = GradSampleModule(model, loss_reduction="sum")
        nn.functional.cross_entropy(forward(gsm, take(x, slice(None))), y, reduction="sum").backward()
        samples = [p.grad_sample.reshape(len(y), -1) for p in model.parameters()]
        torch.testing.assert_close(torch.cat(samples, 1).norm(dim=1), norms, rtol=1e-4, atol=1e-6)
        gsm._close()
    from clients import TrainSettings

    for mode in ("hooks", "vmap"):
        model = _Pooled()
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        _, stats, _ = train_local_dp(model, _reviews(40), TrainSettings(local_epochs=1, batch_size=8, lr=0.1),
                                     LocalDpSettings(grad_sample_mode=mode), torch.Generator().manual_seed(1))
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert stats["dp-path"] == mode and stats["epsilon"] > 0 and not torch.equal(before, after)


def test_named_inputs_round_trip_through_a_data_file_and_the_agents_checks(tmp_path, capsys):
    from clients.cli import _check_builtin

    data = _reviews(12)
    save_npz(tmp_path / "d.npz", data)
    back = Reviews.check_data(load_npz(tmp_path / "d.npz"), "d.npz")
    assert sorted(back.x) == ["ids", "mask", "side"] and np.array_equal(back.y, data.y)
    assert all(np.array_equal(back.x[k], data.x[k]) and back.x[k].dtype == data.x[k].dtype for k in data.x)
    with pytest.raises(ClientError, match=r"holds named inputs \('ids', 'mask', 'side'\): the built-in tasks take one "
                                          r"array x \(n, features\); give the task it was made for with --task"):
        _check_builtin(back, "--data d.npz")
    np.savez(tmp_path / "both.npz", x=np.zeros((2, 3)), **{"x.ids": np.zeros((2, 3))}, y=np.zeros(2))
    with pytest.raises(ClientError, match=r"must hold arrays 'x' and 'y' \(or named inputs 'x.NAME' instead of 'x'\)"):
        load_npz(tmp_path / "both.npz")
    from clients.cli import _data_config

    args = argparse.Namespace(data=str(tmp_path / "d.npz"), partition=None, eval_data=None,
                              task=f"{__file__}:Reviews")
    assert _data_config(args).startswith("data-path=")


def test_the_device_profile_times_a_step_on_named_inputs():
    from clients.profile import measure_profile

    profile = measure_profile(Reviews(), torch.device("cpu"), batch_size=16, data=_reviews(5))
    assert profile["profile-step-ms"] > 0, profile


def test_odd_inputs_and_dtypes_are_one_short_line(tmp_path):
    from collections import UserDict

    data = _reviews(4)
    x, y = dict(data.x), data.y
    huge = "a" * 60_000  # a file's member names are whoever wrote it's: every message cuts them
    np.savez(tmp_path / "many.npz", **{f"x.i{k}": np.zeros(2) for k in range(65)}, y=np.zeros(2))
    np.savez(tmp_path / "long.npz", **{f"x.{huge}": np.zeros(2), "x.b": np.zeros(3)}, y=np.zeros(2))
    with pytest.raises(ClientError, match="must hold at most 64 named inputs. Found 65"):
        load_npz(tmp_path / "many.npz")
    for source in (lambda: Reviews.check_data(load_npz(tmp_path / "long.npz"), "long.npz"),
                   lambda: Reviews.check_data(Dataset({huge: x["ids"]}, y), "f")):
        with pytest.raises(ClientError) as info:
            source()
        assert len(str(info.value)) < 300 and "\n" not in str(info.value)

    class Listed(Reviews):
        x_dtype = ["float32"]

    with pytest.raises(ClientError, match=r"x_dtype must be one of float32, int64, float64, float16, bool or None"):
        Listed.check_data(data, "f")

    class Wide(Reviews):
        x_dtype = "float64"  # a string casts the named inputs of its kind: the floats

    wide = Wide.check_data(data, "f").x
    assert (wide["side"].dtype, wide["ids"].dtype, wide["mask"].dtype) == (np.float64, np.int64, np.bool_)

    class Shaped(Reviews):
        input_shape = {"ids": (8,), "mask": (8,), "side": (2,)}

    with pytest.raises(ClientError, match=r"x must be named inputs \('ids', 'mask', 'side'\) for task Shaped. Found "
                                          r"one array of shape \(4, 8\)"):
        Shaped.check_data(Dataset(x["ids"], y), "f")
    assert sorted(Reviews.check_data(Dataset(UserDict(x), y), "f").x) == ["ids", "mask", "side"]  # a BatchEncoding


def test_an_agents_named_inputs_must_fit_its_models_forward(tmp_path):
    from clients.cli import _data_config

    data = _reviews(6)
    save_npz(tmp_path / "wrong.npz", Dataset({"tokens": data.x["ids"], "mask": data.x["mask"],
                                              "side": data.x["side"]}, data.y))
    args = argparse.Namespace(data=str(tmp_path / "wrong.npz"), partition=None, eval_data=None,
                              task=f"{__file__}:Reviews")
    with pytest.raises(ClientError, match=r"named inputs must fit the task's model. Found _Pooled.forward: it takes no "
                                          r"'tokens'; it needs 'ids'"):
        _data_config(args)
    from clients.tasks.inputs import signature_misfit

    class Packed(nn.Module):  # its own __call__ (or a pre-hook) may rename the inputs: not second-guessed
        def __call__(self, **inputs):
            return self.forward(inputs)

        def forward(self, batch):
            return batch

    hooked = _Pooled()
    hooked.register_forward_pre_hook(lambda m, args, kwargs: (args, kwargs), with_kwargs=True)
    assert signature_misfit(Packed(), ["tokens"]) is None and signature_misfit(hooked, ["tokens"]) is None
    assert signature_misfit(_Pooled(), ["ids", "mask", "side"]) is None


class LazyReviews(Reviews):
    """A lazy head over named inputs: its zeros need each input's dtype (an embedding reads int64 ids)."""

    input_shape = {"ids": (8,), "mask": (8,), "side": (2,)}
    x_dtype = {"ids": "int64", "mask": "bool", "side": "float32"}

    def build_model(self) -> nn.Module:
        model = _Pooled()
        model.out = nn.LazyLinear(3)
        return model


def test_lazy_modules_over_named_inputs_are_sized_with_each_inputs_dtype():
    task = LazyReviews()
    assert task.num_parameters() == _Pooled().out.weight.numel() + 3 + 20 * 16 + 2 * 16 + 16

    class Untyped(LazyReviews):
        x_dtype = "float32"

    with pytest.raises(ClientError, match=r"set x_dtype to a dict giving each named input's dtype \(missing 'ids', "
                                          r"'mask', 'side'\)"):
        Untyped().num_parameters()


def test_from_torch_reads_iterables_and_dataloaders_and_says_when_items_differ_in_shape():
    pairs = [(torch.full((2,), float(i)), i % 2) for i in range(5)]

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(pairs)

    loader = torch.utils.data.DataLoader(pairs, batch_size=2)
    for source in (pairs, Stream(), loader):
        data = Dataset.from_torch(source)
        assert data.x.shape == (5, 2) and data.y.tolist() == [0, 1, 0, 1, 0] and data.x[3, 0] == 3.0
    class Sized(Stream):  # (an iterable dataset with a length: still iterated)
        def __len__(self):
            return 5

    unbatched = torch.utils.data.DataLoader(pairs, batch_size=None)
    for source in (Sized(), unbatched):
        assert Dataset.from_torch(source).x.shape == (5, 2)
    ragged = [(torch.zeros(3), 0), (torch.zeros(4), 1)]
    with pytest.raises(ClientError, match=r"every example's x must have the same shape to stack \(pad sequences "
                                          r"first\). Found \(3,\) and \(4,\)"):
        Dataset.from_torch(ragged)
