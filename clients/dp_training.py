"""Local differential privacy: a client trains with Opacus DP-SGD and keeps its own accountant.

Each step clips every example's gradient to ``max_grad_norm`` (L2, over all
parameters), sums the clipped gradients, adds Gaussian noise of standard deviation
``noise_multiplier * max_grad_norm`` and divides by the expected batch size (rounded down). Batches
are Poisson-sampled: each example joins a batch independently with rate
``q = 1 / ceil(n / batch_size)`` (Opacus's convention; the expected batch size
``n * q`` is at most ``batch_size``), and an epoch is ``ceil(n / batch_size)`` steps.

The client's RDP accountant is a list of ``(noise_multiplier, q, steps)`` events;
:func:`train_local_dp` takes it in and hands it back so it can persist across rounds
(the caller stores it, e.g. in the Flower context's state). Epsilon is for the client's
own records, at the run's ``delta``.

Privacy assumptions: the guarantee is per example of this client's data, for the
records the accountant has seen; it holds only with ``poisson-sampling = true``
(shuffled fixed-size batches are accounted as if Poisson-sampled, an approximation).
Noise and sampling come from one torch generator. Its seed must be secret to the
client: a generator seeded from anything the server knows (the round's seed, the
round number, the node id) lets the server replay the batches and the noise and
subtract it, which voids the guarantee. Pass ``generator=None`` (or
:func:`private_generator`) outside tests. The generator is a seeded PRNG, not Opacus's
``secure_mode`` (torchcsprng, floating-point-attack-safe noise), which is not used here.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from privacy import quiet_import_opacus

from ._errors import ClientError
from .config import TrainSettings, check
from .tasks import Dataset

GRAD_SAMPLE_MODES = ("ghost", "hooks", "functorch")
ACCOUNTANT = "rdp"

# Opacus warnings that are expected here and say nothing to the user: the generator is
# seeded on purpose (see the module docstring), and the first layer's input never
# requires a gradient.
_QUIET = ("Secure RNG turned off", "Full backward hook is firing")


@dataclasses.dataclass(frozen=True)
class LocalDpSettings:
    """Client-side DP-SGD settings.

    ``noise_multiplier`` is the noise standard deviation in units of
    ``max_grad_norm`` (the per-example L2 clipping bound); ``delta`` is the delta of
    the reported (epsilon, delta). ``grad_sample_mode`` picks how per-example
    gradients are computed: ``ghost`` (ghost clipping, two backward passes; Linear and
    Embedding layers' per-example norms come without materialising per-example
    gradients, other layers' are materialised for their norms only; falls back to
    ``hooks`` where the model does not allow it), ``hooks`` or ``functorch``.
    """

    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    grad_sample_mode: str = "ghost"
    poisson_sampling: bool = True

    def __post_init__(self) -> None:
        z, c, d = self.noise_multiplier, self.max_grad_norm, self.delta
        check(_finite(z) and z > 0, "noise-multiplier",
              "be a finite number > 0 (0 adds no noise: no privacy)", z)
        check(_finite(c) and c > 0, "max-grad-norm",
              "be a finite number > 0 (it bounds each example's influence)", c)
        check(_finite(d) and 0 < d < 1, "delta", "be in (0, 1)", d)
        check(self.grad_sample_mode in GRAD_SAMPLE_MODES, "grad-sample-mode",
              f"be one of {list(GRAD_SAMPLE_MODES)}", self.grad_sample_mode)
        check(isinstance(self.poisson_sampling, bool), "poisson-sampling",
              "be true or false", self.poisson_sampling)


def private_generator() -> torch.Generator:
    """A CPU generator seeded from the OS's entropy pool: its draws are unknown to the server."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def resolve_grad_sample_mode(model: nn.Module, requested: str) -> str:
    """The per-example gradient mode that will run for ``model``.

    ``ghost`` needs every trainable layer to have an Opacus norm or grad sampler and
    no parameter shared between layers; otherwise it falls back to ``hooks``.
    Other modes are returned unchanged.
    """
    if requested != "ghost":
        return requested
    quiet_import_opacus()
    from opacus.grad_sample import GradSampleHooksFastGradientClipping as Ghost

    known = set(Ghost.NORM_SAMPLERS) | set(Ghost.GRAD_SAMPLERS)
    seen: set[int] = set()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if type(module) not in known or any(id(p) in seen for p in own):
            return "hooks"
        seen.update(id(p) for p in own)
    return "ghost"


@dataclasses.dataclass
class PrivateTrainer:
    """A model, optimizer and loss made private by Opacus; :meth:`step` is one DP-SGD step."""

    module: nn.Module  # the GradSampleModule wrapping the caller's model
    optimizer: Any  # opacus DPOptimizer
    criterion: Any  # per-example loss wrapper in ghost mode, else nn.CrossEntropyLoss
    loader: torch.utils.data.DataLoader
    grad_sample_mode: str

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward, clipped backward, noisy update; returns the batch's mean loss (detached)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.criterion(self.module(x), y)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def close(self) -> nn.Module:
        """Remove Opacus's hooks and per-parameter attributes; return the plain model."""
        model = self.module.to_standard_module()
        for p in model.parameters():
            if hasattr(p, "summed_grad"):
                del p.summed_grad
        for m in model.modules():
            for attr in ("activations", "max_batch_len"):
                if hasattr(m, attr):
                    delattr(m, attr)
        return model


def make_private_trainer(
    model: nn.Module, loader: torch.utils.data.DataLoader, settings: TrainSettings,
    dp: LocalDpSettings, *, noise_generator: torch.Generator | None, accountant: Any = None,
) -> PrivateTrainer:
    """Wrap ``model`` with Opacus's PrivacyEngine (SGD with ``settings``' lr and momentum).

    ``accountant`` (an opacus RDPAccountant) receives one event per step. Raises
    :class:`ClientError` if the model cannot be trained with per-example clipping.
    """
    quiet_import_opacus()
    from opacus import PrivacyEngine
    from opacus.validators.errors import UnsupportedModuleError

    mode = resolve_grad_sample_mode(model, dp.grad_sample_mode)
    engine = PrivacyEngine(accountant=ACCOUNTANT, secure_mode=False)
    if accountant is not None:
        engine.accountant = accountant
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum)
    try:
        out = engine.make_private(
            module=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(), data_loader=loader,
            noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.max_grad_norm,
            poisson_sampling=dp.poisson_sampling, noise_generator=noise_generator,
            grad_sample_mode=mode,
        )
    except UnsupportedModuleError as exc:
        raise ClientError(
            "model must be compatible with per-example clipping (no BatchNorm, no buffers "
            f"shared across examples), or DP-SGD's bound on one example's influence fails. Found: {exc}"
        ) from None
    module, dp_opt, *rest = out
    criterion = rest[0] if len(rest) == 2 else nn.CrossEntropyLoss()
    return PrivateTrainer(module, dp_opt, criterion, rest[-1], mode)


def accountant_from_state(state: Mapping[str, Any] | None) -> Any:
    """An opacus RDPAccountant holding ``state``'s history (a fresh one for ``None``)."""
    quiet_import_opacus()
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    if state is None:
        return accountant
    where = "accountant-state"
    check(isinstance(state, Mapping) and state.get("mechanism") == ACCOUNTANT, where,
          f"be a mapping with mechanism {ACCOUNTANT!r} (a lost ledger under-reports epsilon)",
          state if not isinstance(state, Mapping) else state.get("mechanism"))
    history = state.get("history")
    check(isinstance(history, list | tuple), f"{where}.history", "be a list", history)
    events = []
    for event in history:
        ok = isinstance(event, list | tuple) and len(event) == 3
        z, q, steps = event if ok else (None, None, None)
        ok = ok and _finite(z) and z > 0 and _finite(q) and 0 < q <= 1
        ok = ok and isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1
        check(ok, f"{where}.history", "hold [noise_multiplier > 0, sample_rate in (0, 1], steps >= 1] events", event)
        events.append((float(z), float(q), int(steps)))
    accountant.history = events
    return accountant


def accountant_to_state(accountant: Any) -> dict[str, Any]:
    """The accountant's ledger as plain JSON-ready data."""
    return {"mechanism": accountant.mechanism(),
            "history": [[float(z), float(q), int(s)] for z, q, s in accountant.history]}


def train_local_dp(
    model: nn.Module, data: Dataset, settings: TrainSettings, dp: LocalDpSettings,
    generator: torch.Generator | None, accountant_state: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, dict[str, float], dict[str, Any]]:
    """DP-SGD for ``settings.local_epochs`` epochs over ``data``; trains ``model`` in place.

    ``generator`` (a CPU torch generator) drives the Poisson sampling and seeds the
    noise, so a seeded call is reproducible (tests); ``None`` takes
    :func:`private_generator`, which a real client must use (see the module docstring:
    a seed the server knows voids the guarantee). ``accountant_state`` is the state
    returned by this client's previous call (``None`` for a first call).

    Returns ``(model, stats, accountant_state)``: the same model object with plain
    parameters (no Opacus hooks or attributes; parameter order unchanged); stats
    ``train-loss``, ``train-time-s``, ``epsilon`` (all steps so far, at ``dp.delta``),
    ``dp-steps`` (this call) and ``dp-sample-rate``; and the updated ledger.
    """
    if len(data) == 0:
        raise ClientError("data must hold at least one example for DP-SGD. Found 0.")
    device = next(model.parameters()).device
    x = torch.from_numpy(np.ascontiguousarray(data.x)).to(device)
    y = torch.from_numpy(np.ascontiguousarray(data.y)).to(device)
    accountant = accountant_from_state(accountant_state)
    generator = private_generator() if generator is None else generator
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=min(settings.batch_size, len(y)),
        shuffle=not dp.poisson_sampling, generator=generator,
    )
    noise_generator = torch.Generator(device=device)
    noise_generator.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    model.train()
    start = time.perf_counter()
    total, seen, steps = 0.0, 0, 0
    with warnings.catch_warnings():
        for message in _QUIET:
            warnings.filterwarnings("ignore", message=message)
        trainer = make_private_trainer(model, loader, settings, dp, noise_generator=noise_generator,
                                       accountant=accountant)
        try:
            for _ in range(settings.local_epochs):
                for xb, yb in trainer.loader:
                    loss = trainer.step(xb, yb)
                    steps += 1
                    if len(yb):  # Poisson sampling can draw an empty batch: noise only
                        total += loss.item() * len(yb)
                        seen += len(yb)
        finally:
            model = trainer.close()
    stats = {
        "train-loss": total / max(seen, 1),
        "train-time-s": time.perf_counter() - start,
        "epsilon": float(accountant.get_epsilon(dp.delta)),
        "dp-steps": float(steps),
        "dp-sample-rate": 1.0 / len(loader),
    }
    return model, stats, accountant_to_state(accountant)


__all__ = [
    "GRAD_SAMPLE_MODES",
    "LocalDpSettings",
    "PrivateTrainer",
    "accountant_from_state",
    "accountant_to_state",
    "make_private_trainer",
    "private_generator",
    "resolve_grad_sample_mode",
    "train_local_dp",
]
