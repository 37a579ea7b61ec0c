"""The task interface: the user's model, data, loss and (optionally) training loop.

A task is a subclass of :class:`Task` that gives ``build_model()`` and ``load_data()``; everything else has
a default for classification. fedshield never sees the module itself on the hot path: a :class:`ModelLayout`
derived once from it says which tensors travel as the flat float32 update. See docs/tasks.md.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from logging import INFO
from typing import Any

import numpy as np
import torch
from torch import nn

from .._errors import ClientError, ConfigError
from ..config import TaskSpec, TrainSettings
from ..partition import dirichlet_partition, iid_partition
from .inputs import MAX_INPUTS, forward, leaves, named, names_shown, signature_misfit, take, to_tensors
from .layout import ModelLayout, frozen_summary
from .sgd import SGD

_DTYPES = {"float32": np.float32, "int64": np.int64, "float64": np.float64, "float16": np.float16, "bool": np.bool_}
_GLOBAL_RNG = threading.Lock()
_SAID: set[tuple[type, str]] = set()  # tasks (class, name) whose private model's change has been logged
_GLOBAL_SEED_SALT = 0x5DEECE66D  # the global generator's seed differs from the batches' generator's own


def normalises_by_batch(model: nn.Module) -> bool:
    """Whether ``model`` has BatchNorm layers (training statistics over each batch: no padding, no batch of one)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def epoch_batches(perm: torch.Tensor, batch_size: int, merge_one: bool) -> tuple[torch.Tensor, ...]:
    """An epoch's batches of ``perm``; ``merge_one``: a last batch of one example joins the one before it."""
    batches = perm.split(batch_size)
    if merge_one and batch_size > 1 and len(batches) > 1 and len(batches[-1]) == 1:
        return (*batches[:-2], perm[-batch_size - 1:])
    return batches


@dataclass(frozen=True)
class Dataset:
    """Examples as arrays: ``x`` of shape (n, ...) (features, images (n, C, H, W), token ids), or named inputs, a
    dict of such arrays (token ids and their mask; a user's and an item's ids with side features), which the model's
    forward takes as keyword arguments; ``y`` of shape (n, ...) (class labels, multi-label or regression targets,
    next tokens)."""

    x: Any  # np.ndarray, or dict[str, np.ndarray] of named inputs
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)

    def take(self, index: Any) -> Dataset:
        """The examples ``index`` (indices, a mask or a slice), of every input and the targets."""
        return type(self)(take(self.x, index), self.y[index])

    @classmethod
    def from_torch(cls, data: Any) -> Dataset:
        """``(x, y)`` pairs stacked into arrays, read once: from a torch map-style dataset, an iterable one, or a
        DataLoader (its batches concatenated, in its order); an ``x`` that is a dict of tensors or arrays (a
        tokenizer's output) becomes named inputs. Items of different shapes (sequences of different lengths) are one
        ClientError: pad them first, to one length for the whole dataset."""
        loader = isinstance(data, torch.utils.data.DataLoader) and data.batch_size is not None  # (None: unbatched)
        if (isinstance(data, torch.utils.data.DataLoader | torch.utils.data.IterableDataset)
                or not (hasattr(data, "__getitem__") and hasattr(data, "__len__"))):
            pairs = list(data)
        else:
            pairs = [data[i] for i in range(len(data))]
        if any(not isinstance(p, list | tuple) or len(p) != 2 for p in pairs[:1]):
            raise ClientError(f"Dataset.from_torch needs (x, y) pairs. Found {type(pairs[0]).__name__}.")
        xs, ys = (list(v) for v in zip(*pairs, strict=True)) if pairs else ([], [])
        join = np.concatenate if loader else np.stack

        def joined(parts: list, what: str) -> np.ndarray:
            arrays = [np.asarray(p.cpu() if isinstance(p, torch.Tensor) else p) for p in parts]
            shapes = sorted({a.shape[1:] if loader else a.shape for a in arrays}, key=str)
            if len(shapes) > 1:
                raise ClientError(f"Dataset.from_torch: every example's {what} must have the same shape to stack "
                                  f"(pad sequences first). Found {shapes[0]} and {shapes[1]}.")
            return join(arrays) if arrays else np.zeros(0)

        if xs and isinstance(xs[0], Mapping):  # (a tokenizer's BatchEncoding is a UserDict)
            x: Any = {k: joined([item[k] for item in xs], f"{k!r}") for k in xs[0]}
        else:
            x = joined(xs, "x")
        return cls(x, joined(ys, "y"))


class Task(ABC):
    """A learning task: subclass it, give ``build_model`` and ``load_data``, override what differs.

    Class attributes a subclass may set:

    - ``num_classes``: labels are checked to lie in ``[0, num_classes)`` (None: not checked);
    - ``x_dtype`` / ``y_dtype``: what ``x`` and ``y`` are cast to (``"float32"``, ``"int64"``, ``"float64"``,
      ``"float16"``, or None to keep);
      named inputs are cast by kind (floats as float32, integers as int64, bools kept) unless ``x_dtype`` is a
      dict by name;
    - ``input_shape`` / ``target_shape``: ``x``'s and ``y``'s shapes past the example axis, checked when set
      (named inputs: a dict of shapes by name);
    - ``federate_buffers``: False keeps every buffer (BatchNorm's running statistics) on its client (FedBN);
    - ``keep_local``: state-dict name globs kept on each client (e.g. ``("*.bn*",)`` for FedBN with its
      affine parameters too);
    - ``federate_frozen``: True sends parameters built with ``requires_grad=False`` (a fine-tuned model's
      backbone) every round like the others; by default they stay off the wire, every node and the coordinator
      taking them from the run seed's build, and a client whose training changes one is refused in one line;
    - ``channels_last``: whether the default ``train`` and ``evaluate`` run the model in channels-last memory
      format (None: on CPU, for models with 2-D convolutions whose forward accepts it; 1.3-2.4x faster here).
    """

    name: str = ""
    num_classes: int | None = None
    x_dtype: str | dict[str, str | None] | None = "float32"
    y_dtype: str | None = "int64"
    federate_buffers: bool = True
    keep_local: tuple[str, ...] = ()
    federate_frozen: bool = False
    input_shape: tuple[int, ...] | dict[str, tuple[int, ...]] | None = None  # x's shape past the example axis
    target_shape: tuple[int, ...] | None = None  # y's likewise (() for one label per example)
    channels_last: bool | None = None  # None: auto (CPU, 2-D convolutions, a forward that accepts it)

    def __init__(self, spec: TaskSpec | None = None) -> None:
        self.spec = spec if spec is not None else TaskSpec()

    # --- what the user gives -------------------------------------------------------------------------

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (random state seeded by the caller)."""

    @abstractmethod
    def load_data(self) -> tuple[Dataset, Dataset]:
        """(train, test) for the whole task: clients split ``train`` (``client_data``), the coordinator
        evaluates on ``test``. Keep the split fixed for a given ``self.spec.data_seed``."""

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The mean loss of a batch (default: cross-entropy over the last axis of ``output``)."""
        if output.ndim > 2:  # (n, ..., classes) against (n, ...): sequences of tokens
            return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
        return nn.functional.cross_entropy(output, target)

    def metrics(self, output: Any, target: torch.Tensor) -> dict[str, float]:
        """A batch's metrics as means (default: ``accuracy`` when ``output`` is a tensor of class scores for
        ``target``'s class labels; none for an output of another kind, a dict or a tuple, which ``loss`` reads)."""
        if (isinstance(output, torch.Tensor) and not target.dtype.is_floating_point
                and output.shape[:-1] == target.shape):
            return {"accuracy": (output.argmax(-1) == target).sum().item() / max(target.numel(), 1)}  # (exact: a count)
        return {}

    def augment(self, x: Any, y: torch.Tensor, generator: torch.Generator) -> tuple[Any, torch.Tensor]:
        """A training batch's inputs and targets, transformed before each step of the default loop and of local DP
        (random crops, flips, noise: draw from ``generator``, the node's, so a rerun repeats them; it lives on the
        CPU). The default returns them unchanged; evaluation never augments. Return as many examples as given, and
        under local DP transform each example on its own (a mix of two, as mixup makes, would let one example move
        another's gradient, outside DP-SGD's bound)."""
        return x, y

    def train(self, model: nn.Module, data: Dataset, settings: TrainSettings,
              generator: torch.Generator) -> dict[str, float]:
        """Train ``model`` in place on ``data``; return metrics (``train-loss`` if known).

        The default: SGD with momentum over shuffled mini-batches for ``settings.local_epochs`` epochs,
        plus FedProx's proximal term ``mu / 2 * ||w - w_global||^2`` when ``settings.proximal_mu > 0``. For a
        model with BatchNorm an epoch's last batch of one example joins the batch before it (``BatchNorm1d``
        refuses a batch of one in training: such a client failed every round).
        """
        device = _device_of(model)
        x, y = _tensors(data, device)
        with self._memory_format(model, x):
            params = [p for p in model.parameters() if p.requires_grad]
            opt = SGD(params, lr=settings.lr, momentum=settings.momentum)
            mu = settings.proximal_mu
            anchor = [p.detach().clone() for p in params] if mu > 0 else []
            total, seen = 0.0, 0
            model.train()
            merge = normalises_by_batch(model)
            for _ in range(settings.local_epochs):
                perm = torch.randperm(len(y), generator=generator).to(device)
                for batch in epoch_batches(perm, settings.batch_size, merge):
                    opt.zero_grad(set_to_none=True)
                    xb, yb = augmented(self, take(x, batch), y[batch], generator)
                    loss = self.loss(forward(model, xb), yb)
                    loss.backward()
                    if mu > 0:  # the proximal term's gradient, mu (w - w_global), added in one fused pass
                        grads = [_dense_grad(p) for p in params]
                        torch._foreach_add_(grads, torch._foreach_sub(params, anchor), alpha=mu)
                        for p, g in zip(params, grads, strict=True):
                            p.grad = g
                    opt.step()
                    total += loss.item() * len(batch)
                    seen += len(batch)
        return {"train-loss": total / max(seen, 1)}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: Dataset, batch_size: int = 1024) -> dict[str, float]:
        """``loss`` and the task's metrics on ``data``, example-weighted means over batches."""
        device = _device_of(model)
        x, y = _tensors(data, device)
        sums: dict[str, float] = {}
        with self._memory_format(model, x):
            model.eval()
            for start in range(0, len(y), batch_size):
                part = slice(start, start + batch_size)
                yb, out = y[part], forward(model, take(x, part))
                for key, value in {"loss": self.loss(out, yb).item(), **self.metrics(out, yb)}.items():
                    sums[key] = sums.get(key, 0.0) + float(value) * len(yb)
        return {k: v / max(len(y), 1) for k, v in sums.items()}

    @contextmanager
    def _memory_format(self, model: nn.Module, x: Any):
        """The default loops' model in channels-last memory format while they run (see ``channels_last``),
        and back in the default format after, so nothing outside the loop sees other strides."""
        use = self.channels_last
        if use is None:
            use = _channels_last_ok(self, model, x)
        if not use:
            yield
            return
        model.to(memory_format=torch.channels_last)
        try:
            yield
        finally:
            model.to(memory_format=torch.contiguous_format)

    # --- what fedshield derives ----------------------------------------------------------------------

    @cached_property
    def _data(self) -> tuple[Dataset, Dataset]:
        train, test = self.load_data()
        where = self.spec.task
        return self.check_data(train, f"{where} training data"), self.check_data(test, f"{where} test data")

    @property
    def train_set(self) -> Dataset:
        return self._data[0]

    @property
    def test_set(self) -> Dataset:
        return self._data[1]

    def client_data(self, partition_id: int, num_partitions: int) -> Dataset:
        """Client ``partition_id``'s training data (default: its share of ``train_set``, split by the
        spec's partitioning)."""
        return self.partition(partition_id, num_partitions)

    def client_eval_data(self, partition_id: int, num_partitions: int) -> Dataset:
        """Client ``partition_id``'s held-out data for federated evaluation (default: its share of ``test_set``,
        an iid split; with more clients than test examples, client k gets example k mod n)."""
        if not 0 <= partition_id < num_partitions:
            raise ClientError(f"partition-id must be in [0, {num_partitions}). Found {partition_id}.")
        test = self.test_set
        if num_partitions > len(test):
            idx = np.array([partition_id % len(test)])
        else:
            cache = self.__dict__.setdefault("_eval_parts", {})
            if num_partitions not in cache:
                cache[num_partitions] = iid_partition(len(test), num_partitions, self.spec.data_seed + 2)
            idx = cache[num_partitions][partition_id]
        return test.take(idx)

    def partition(self, partition_id: int, num_partitions: int) -> Dataset:
        """Client ``partition_id``'s share of the training set (deterministic)."""
        if not 0 <= partition_id < num_partitions:
            raise ClientError(f"partition-id must be in [0, {num_partitions}). Found {partition_id}.")
        if self.spec.partitioning == "sample":
            idx = self._sampled_indices(partition_id)
        else:
            idx = self._partition_indices(num_partitions)[partition_id]
        return self.train_set.take(idx)

    def _sampled_indices(self, partition_id: int) -> np.ndarray:
        """Partitioning "sample": client k draws ``client-examples`` training examples with replacement, its own
        class mix from Dirichlet(dirichlet-alpha) when y holds class labels; made on demand from a generator
        keyed by (data-seed, k), so a population of any size costs nothing until a client is sampled."""
        y, m = self.train_set.y, self.spec.client_examples
        rng = np.random.default_rng([self.spec.data_seed, 7, partition_id])
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            return rng.integers(0, len(y), m)
        by_class = self.__dict__.get("_by_class")
        if by_class is None:  # once: each class's indices, and where each class starts in the sorted order
            order = np.argsort(y, kind="stable")
            classes, starts, counts = np.unique(y[order], return_index=True, return_counts=True)
            by_class = self.__dict__["_by_class"] = (order, starts, counts)
        order, starts, counts = by_class
        mix = rng.dirichlet(np.full(len(starts), self.spec.dirichlet_alpha))
        cls = rng.choice(len(starts), size=m, p=mix)
        return order[starts[cls] + (rng.random(m) * counts[cls]).astype(np.int64)]

    def _partition_indices(self, num_partitions: int) -> list[np.ndarray]:
        cache = self.__dict__.setdefault("_parts", {})
        if num_partitions not in cache:
            seed, y = self.spec.data_seed + 1, self.train_set.y
            if self.spec.partitioning == "iid":
                cache[num_partitions] = iid_partition(len(y), num_partitions, seed)
            elif y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
                raise ConfigError(f"partitioning 'dirichlet' splits by class label and needs y of shape (n,) with "
                                  f"integer labels. Found y {y.dtype} {y.shape} in task {self.spec.task!r}: set "
                                  "partitioning = \"iid\".")
            else:
                cache[num_partitions] = dirichlet_partition(y, num_partitions, self.spec.dirichlet_alpha, seed)
        return cache[num_partitions]

    @classmethod
    def _check_dtypes(cls) -> None:
        """``x_dtype`` and ``y_dtype`` are names of dtypes (``bool`` for inputs only) or None; ClientError else."""
        for attr in ("x_dtype", "y_dtype"):
            value = getattr(cls, attr)
            allowed = [k for k in _DTYPES if attr == "x_dtype" or k != "bool"]
            for kind in (value.values() if isinstance(value, dict) and attr == "x_dtype" else [value]):
                if kind is not None and not (isinstance(kind, str) and kind in allowed):
                    raise ClientError(f"task {cls.name or cls.__name__}: {attr} must be one of {', '.join(allowed)} or "
                                      f"None{' (or a dict of them by input name)' if attr == 'x_dtype' else ''}. Found "
                                      f"{str(kind)[:40]!r}.")

    @classmethod
    def check_data(cls, data: Dataset, source: str) -> Dataset:
        """``data`` checked against the task (shapes, dtypes, label range, finite values) and cast to the
        task's dtypes; ClientError naming ``source`` and the rule otherwise."""
        cls._check_dtypes()
        if isinstance(data.x, Mapping) and not isinstance(data.x, dict):  # (a UserDict: named inputs too)
            data = Dataset(dict(data.x), data.y)
        y, is_named, task = np.asarray(data.y), isinstance(data.x, dict), cls.name or cls.__name__
        x = _check_named(data.x, source) if is_named else {"x": np.asarray(data.x)}
        by_name = isinstance(cls.input_shape, dict)
        if by_name != is_named and cls.input_shape is not None:
            raise ClientError(f"{source}: x must be named inputs ({names_shown(cls.input_shape)}) for task {task}. "
                              f"Found one array of shape {x['x'].shape}." if by_name else
                              f"{source}: named inputs need input_shape to be a dict of shapes by name (or None). "
                              f"Found {cls.input_shape!r} for task {task}.")
        shapes = cls.input_shape if by_name else {"x": cls.input_shape}
        if by_name and set(shapes) != set(x):
            raise ClientError(f"{source}: x must hold the inputs {names_shown(sorted(shapes))} for task {task}. "
                              f"Found {names_shown(sorted(x))}.")
        for what, a in (*x.items(), ("y", y)):
            if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)
                    or (what != "y" and a.dtype == np.bool_ and is_named)):
                raise ClientError(f"{source}: {what} must be numeric. Found dtype {a.dtype}.")
            if a.ndim == 0:
                raise ClientError(f"{source}: {what} must have a leading example axis. Found a scalar.")
        for what, a in x.items():
            want = shapes.get(what)
            if want is not None and a.shape[1:] != tuple(want):
                shape = ", ".join(map(str, ("n", *want)))
                raise ClientError(f"{source}: {what} must have shape ({shape}) for task {task}. Found {a.shape}.")
        n = len(next(iter(x.values())))
        if any(len(a) != n for a in x.values()):
            first, *odd = [(k, a) for i, (k, a) in enumerate(x.items()) if i == 0 or len(a) != n]  # (the first, then
            raise ClientError(f"{source}: every input must hold the same number of examples. Found "  # the odd ones)
                              + ", ".join(f"{names_shown([k])} {len(a)}" for k, a in [first, *odd[:3]]) + ".")
        if len(y) != n or (cls.target_shape is not None and y.shape[1:] != cls.target_shape):
            want = (n, *(y.shape[1:] if cls.target_shape is None else cls.target_shape))
            raise ClientError(f"{source}: y must have shape {want} (one target per example of x). Found {y.shape}.")
        if len(y) == 0:
            raise ClientError(f"{source}: x and y must hold n > 0 examples. Found x{_shapes(x)} y{y.shape}.")
        if cls.y_dtype == "int64" and not np.issubdtype(y.dtype, np.integer):
            raise ClientError(f"{source}: y must hold integer labels. Found dtype {y.dtype}.")
        if cls.num_classes is not None and (y.min() < 0 or y.max() >= cls.num_classes):
            raise ClientError(f"{source}: y must hold integer labels in [0, {cls.num_classes}). Found {y.dtype} "
                              f"{y.min()}..{y.max()}.")
        if isinstance(cls.x_dtype, dict) and (unknown := sorted(set(cls.x_dtype) - set(x), key=str)):  # a misspelt name cast nothing
            raise ClientError(f"{source}: x_dtype of task {task} must name only its inputs {names_shown(sorted(x))}. "
                              f"Found {names_shown(unknown)}.")
        x = {k: _cast(a, _input_dtype(cls.x_dtype, k, a, is_named)) for k, a in x.items()}
        y = _cast(y, cls.y_dtype)
        for what, a in (*x.items(), ("y", y)):
            if a.dtype.kind == "f" and not np.isfinite(a).all():
                big = np.finfo(a.dtype).max
                raise ClientError(f"{source}: {what} must be finite as {a.dtype}. Found NaN, inf or |{what}| > {big:.3g}.")
        return Dataset(x if is_named else x["x"], y)

    def build(self, private: bool = False) -> nn.Module:
        """The task's model; ``private``: made trainable by DP-SGD (Opacus's ModuleValidator.fix, e.g.
        BatchNorm -> GroupNorm), said in one log line when it changed anything."""
        model = self.build_model()
        if not isinstance(model, nn.Module):
            raise ClientError(f"task {self.spec.task!r}: build_model must return a torch.nn.Module. Found "
                              f"{type(model).__name__}.")
        self._materialise(model)
        return _private_model(model, self.spec.task, type(self)) if private else model

    def _materialise(self, model: nn.Module) -> None:
        """Lazy modules (``nn.LazyLinear``...) given their sizes by one forward of zeros shaped as ``input_shape``
        (eval mode, no grad: no statistics move), on the model's device, drawn from the caller's generator as any
        other initialisation; ClientError without ``input_shape``, which the layout needs before any data."""
        from torch.nn.modules.lazy import LazyModuleMixin

        lazy = [(n, type(m).__name__) for n, m in model.named_modules()
                if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]
        if not lazy:
            return
        shapes = self.input_shape
        if shapes is None:
            raise ClientError(f"task {self.spec.task!r}: build_model returns lazy modules ({lazy[0][1]} {lazy[0][0]!r}), "
                              "whose sizes a first forward sets: set the task's input_shape (x's shape past the "
                              "example axis) so that fedshield runs one, or give their sizes.")
        self._check_dtypes()
        device = next(iter(model.parameters())).device
        if isinstance(shapes, dict):  # named inputs are cast by the data's kind, unknown before any data
            dtypes = self.x_dtype if isinstance(self.x_dtype, dict) else {}
            unknown = [k for k in shapes if dtypes.get(k) is None]
            if unknown:
                raise ClientError(f"task {self.spec.task!r}: build_model returns lazy modules ({lazy[0][1]} "
                                  f"{lazy[0][0]!r}), sized by a forward of zeros: set x_dtype to a dict giving each "
                                  f"named input's dtype (missing {names_shown(unknown)}), so that the zeros are what "
                                  "the data will be.")
        else:
            kind = self.x_dtype.get("x") if isinstance(self.x_dtype, dict) else self.x_dtype
            dtypes = {"x": kind or "float32"}

        zeros = {k: np.zeros((1, *v), _DTYPES[dtypes[k]]) for k, v in (shapes if isinstance(shapes, dict) else
                                                                         {"x": shapes}).items()}
        x = to_tensors(zeros if isinstance(shapes, dict) else zeros["x"], device)
        mode = model.training
        try:
            with torch.no_grad():
                forward(model.eval(), x)
        finally:
            model.train(mode)

    def working_model(self, device: torch.device) -> nn.Module:
        """A non-private model on ``device`` for a message to load its weights and kept entries into (the
        layout's entries and ``layout.local`` are the caller's to load: ``initial_local`` before a node's first
        round). The default ``train`` and ``evaluate`` never change a module, so with them one model per thread
        and device is kept, its gradients cleared: a model built per message was most of a simulated client's
        overhead (1.4 ms of a ResNet's)."""
        if type(self).train is not Task.train or type(self).evaluate is not Task.evaluate:
            return self.build().to(device)  # a loop of the user's may change its module: a fresh one each time
        cache = self.__dict__.setdefault("_working_models", {})
        key = (threading.get_ident(), device)
        if key not in cache:
            cache[key] = self.build().to(device)
        model = cache[key]
        for p in model.parameters():
            p.grad = None
        return model

    def layout(self, private: bool = False) -> ModelLayout:
        """The model's layout, derived once (from a model on the meta device where it builds there)."""
        cache = self.__dict__.setdefault("_layouts", {})
        if private not in cache:
            cache[private] = ModelLayout.of(self._meta_build(private), self.federate_buffers, tuple(self.keep_local),
                                            self.federate_frozen)
        return cache[private]

    def _meta_build(self, private: bool = False) -> nn.Module:
        """The model built on the meta device (no memory, no initialisation), or for real where it cannot be."""
        try:
            with torch.device("meta"):
                return self.build(private)
        except (RuntimeError, NotImplementedError, TypeError):  # a model that needs real tensors to build
            return self.build(private)

    def inputs_misfit(self, x: Any) -> str | None:
        """Why named inputs ``x`` do not fit the model's forward (names it does not take, arguments it needs), or
        None: an agent checks its data file's names before its node starts, not at the first reply."""
        return signature_misfit(self._meta_build(), x) if named(x) else None

    def num_parameters(self, private: bool = False) -> int:
        """Elements of the flat update (parameters plus federated buffers), from the layout: a message or
        config asking for a huge model is measured before anything of that size exists."""
        return self.layout(private).numel

    def init_weights(self, seed: int, private: bool = False) -> torch.Tensor:
        """The initial global model as one flat float32 tensor (seeded)."""
        return self.layout(private).flatten(self._seeded_build(seed, private))

    def initial_local(self, seed: int, private: bool = False) -> dict[str, torch.Tensor]:
        """Where a client's kept entries (``layout.local``) start before its first round, and its frozen ones
        (``layout.fixed``) every round: the model ``init_weights(seed)`` builds, so a kept or frozen parameter drawn
        at random (a personal head, random features) is the same on every node, engine and process, whichever task
        instance or thread serves it (CPU tensors, cached and shared: callers copy them into their models)."""
        cache = self.__dict__.setdefault("_initial_local", {})
        key = (seed, private)
        if key not in cache:
            local = self.layout(private).local
            state = self._seeded_build(seed, private).state_dict() if local else {}
            cache[key] = {name: state[name].detach().cpu().clone() for name in local}  # (frozen ones too)
        return cache[key]

    def frozen_summary(self, seed: int, private: bool = False) -> tuple[float, ...]:
        """``layout.frozen_summary`` of the frozen entries (``layout.fixed``) the run seed's build gives, () without
        any: the coordinator sends its own with each instruction and a node whose build differs (features drawn
        from numpy's generator, another pretrained file) refuses, since the trained weights would meet other frozen
        values there than on the coordinator."""
        fixed = self.layout(private).fixed
        if not fixed:
            return ()
        cache = self.__dict__.setdefault("_frozen_summaries", {})
        if (seed, private) not in cache:
            start = self.initial_local(seed, private)
            cache[seed, private] = frozen_summary([start[name] for name in fixed])
        return cache[seed, private]

    def _seeded_build(self, seed: int, private: bool) -> nn.Module:
        with _GLOBAL_RNG, torch.random.fork_rng(devices=[]):  # (torch's global generator: one seeded build at a time)
            torch.manual_seed(seed)
            return self.build(private)

    def sample_batch(self, data: Dataset, size: int) -> Dataset:
        """The first ``size`` examples of ``data`` (the device profile times a training step on them)."""
        return data.take(slice(0, size))


def _cast(a: np.ndarray, dtype: str | None) -> np.ndarray:
    if dtype is None:
        return a
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused next, with its reason
        return a.astype(_DTYPES[dtype], copy=False)


def _check_named(x: dict, source: str) -> dict[str, np.ndarray]:
    """Named inputs' names (keyword arguments of the model's forward: identifiers) and arrays."""
    if not x or len(x) > MAX_INPUTS:
        raise ClientError(f"{source}: named inputs must be 1 to {MAX_INPUTS} arrays. Found {len(x)}.")
    bad = [k for k in x if not (isinstance(k, str) and k.isidentifier() and not k.startswith("_") and len(k) <= 64)]
    if bad:
        raise ClientError(f"{source}: named inputs' names must be identifiers of at most 64 characters (the forward's "
                          f"keyword arguments), not starting with '_'. Found {names_shown(bad[:1])}.")
    return {k: np.asarray(a) for k, a in x.items()}


def _input_dtype(x_dtype: Any, name: str, a: np.ndarray, is_named: bool) -> str | None:
    """What input ``name`` is cast to: ``x_dtype[name]`` where ``x_dtype`` is a dict naming it; ``x_dtype`` for one
    input; for named inputs, a string ``x_dtype`` casts those of its kind (``"float64"`` the floats), None keeps
    them all, and the rest go by kind (floats to float32, integers to int64: ids, bools kept)."""
    if isinstance(x_dtype, dict):
        return x_dtype[name] if name in x_dtype else _by_kind(a)
    if not is_named or x_dtype is None:
        return x_dtype
    same = np.dtype(_DTYPES[x_dtype]).kind.replace("u", "i") == a.dtype.kind.replace("u", "i")
    return x_dtype if same else _by_kind(a)


def _by_kind(a: np.ndarray) -> str | None:
    return "float32" if a.dtype.kind == "f" else "int64" if a.dtype.kind in "iu" else None


def _shapes(x: dict[str, np.ndarray]) -> Any:
    return x["x"].shape if list(x) == ["x"] else {k: a.shape for k, a in x.items()}


def _channels_last_ok(task: Task, model: nn.Module, x: Any) -> bool:
    """Auto ``channels_last``: on CPU, for a model with 2-D convolutions whose forward takes it (one example,
    eval mode, no grad: no state changes). A forward that ``.view``s a channels-last activation (or fails
    otherwise) keeps the default format. The verdict is kept per task and model structure."""
    if _device_of(model).type != "cpu":
        return False
    cache = task.__dict__.setdefault("_channels_last_verdicts", {})
    key = tuple(type(m) for m in model.modules())
    if key not in cache:
        cache[key] = nn.Conv2d in key and _forward_takes_channels_last(model, x)
    return cache[key]


def _forward_takes_channels_last(model: nn.Module, x: Any) -> bool:
    mode = model.training
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}  # a forward may count its calls
    model.to(memory_format=torch.channels_last)
    try:
        with torch.no_grad():
            forward(model.eval(), take(x, slice(0, 1)))
        return True
    except Exception:  # noqa: BLE001 - any failure here means: keep the format the model was built in
        return False
    finally:
        model.to(memory_format=torch.contiguous_format)
        model.train(mode)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(saved[name])


def augments(task: Task) -> bool:
    """Whether ``task`` overrides :meth:`Task.augment`."""
    return type(task).augment is not Task.augment


def augmented(task: Task, x: Any, y: torch.Tensor, generator: torch.Generator) -> tuple[Any, torch.Tensor]:
    """``task.augment`` of a batch, checked: as many examples of every input and target as were given (a batch's
    size weighs its loss; under local DP it is the sampled batch the noise is calibrated to)."""
    if not augments(task):
        return x, y
    out = task.augment(x, y, generator)
    ok = isinstance(out, tuple) and len(out) == 2
    lengths = {len(a) for a in (*leaves(out[0]), out[1])} if ok and isinstance(out[1], torch.Tensor) else set()
    if not ok or lengths != {len(y)} or named(out[0]) != named(x):
        raise ClientError(f"task {task.spec.task!r}: augment must return (x, y) with the {len(y)} examples it was "
                          f"given, x of the same kind. Found {type(out).__name__} {sorted(lengths)[:3]}.")
    return out


def _dense_grad(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient as a dense tensor (zeros where none): the proximal term touches every entry, and a sparse
    gradient (``nn.Embedding(sparse=True)``) cannot take a dense addend in place."""
    if p.grad is None:
        return torch.zeros_like(p)
    return p.grad.to_dense() if p.grad.is_sparse else p.grad


def _device_of(model: nn.Module) -> torch.device:
    ref = next(model.parameters(), None)
    if ref is None:
        ref = next(model.buffers(), None)
    return ref.device if ref is not None else torch.device("cpu")


def _tensors(data: Dataset, device: torch.device) -> tuple[Any, torch.Tensor]:
    """``data``'s inputs (a tensor, or a dict of them) and targets as tensors on ``device``."""
    return to_tensors(data.x, device), to_tensors(data.y, device)


def _private_model(model: nn.Module, name: str, cls: type) -> nn.Module:
    from privacy import quiet_import_opacus

    quiet_import_opacus()
    from opacus.validators import ModuleValidator

    if ModuleValidator.is_valid(model):
        return model
    before = {type(m).__name__ for m in model.modules()}
    fixed = ModuleValidator.fix(model)
    after = {type(m).__name__ for m in fixed.modules()}
    if not ModuleValidator.is_valid(fixed):
        errors = "; ".join(str(e) for e in ModuleValidator.validate(fixed, strict=False))[:300]
        raise ClientError(f"task {name!r}: the model must be trainable by DP-SGD for local DP. Found: {errors}.")
    if (cls, name) not in _SAID:  # once per task and process: a model is built for its layout, weights, each round
        from flwr.common.logger import log

        _SAID.add((cls, name))
        log(INFO, "[fedshield] local DP: task %s's model changed for DP-SGD by Opacus (%s -> %s)", name,
            ", ".join(sorted(before - after)) or "-", ", ".join(sorted(after - before)) or "-")
    return fixed


def timed_train(task: Task, model: nn.Module, data: Dataset, settings: TrainSettings,
                generator: torch.Generator) -> dict[str, float]:
    """``task.train`` with its wall time as ``train-time-s``; a user's train that returns None is fine."""
    start = time.perf_counter()
    device = _device_of(model)
    # torch's global generator (dropout, a user's torch.rand) seeded from the node's round generator, which keys
    # it by run seed, round and data without drawing from it: a rerun or resume repeats each client's draws
    seed = generator.initial_seed() ^ _GLOBAL_SEED_SALT
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.default_generator.manual_seed(seed)  # (not torch.manual_seed: it reseeds every GPU, restored or not)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        stats = task.train(model, data, settings, generator) or {}
    if not isinstance(stats, dict):
        raise ClientError(f"task {task.spec.task!r}: train must return a dict of metrics or None. Found "
                          f"{type(stats).__name__}.")
    from ..protocol import real_number  # (a loss returned as a 0-d tensor or numpy value counts: it was dropped)

    numbers = {k: real_number(v) for k, v in stats.items()}
    return {**{k: v for k, v in numbers.items() if v is not None}, "train-time-s": time.perf_counter() - start}


__all__ = ["Dataset", "Task", "augmented", "augments", "timed_train"]
