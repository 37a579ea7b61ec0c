"""Local differential privacy: a client trains with Opacus DP-SGD and keeps its own accountant.

Each step clips every example's gradient to ``max_grad_norm`` (L2, over all
parameters), sums the clipped gradients, adds Gaussian noise of standard deviation
``noise_multiplier * max_grad_norm`` and divides by the expected batch size (rounded down). Batches
are Poisson-sampled: each example joins a batch independently with rate
``q = 1 / ceil(n / batch_size)`` (Opacus's convention; the expected batch size
``n * q`` is at most ``batch_size``), and an epoch is ``ceil(n / batch_size)`` steps.

The client's ledger is a list of ``(noise_multiplier, q, steps)`` events (recorded by
an opacus accountant object, whose ``history`` it is; the state's ``mechanism`` stays
``"rdp"``, opacus's name for that recorder, so ledgers written before and after read the
same); :func:`train_local_dp` takes it in and hands it back so it can persist across
rounds (the caller stores it, e.g. in the Flower context's state). Epsilon is for the
client's own records, at the run's ``delta``, composed by ``LocalDpSettings.accountant``
(fedshield's PLD accountant by default, or RDP): each step is a Poisson-subsampled
Gaussian event, grouped by (q, z) with counts.

Paths. ``grad_sample_mode = "fast"`` (the default) runs fedshield's own per-example
clipping for models built only of ``nn.Linear`` and ``nn.Conv2d`` layers and
parameter-free per-example layers (activations, pooling, flatten, dropout) chained
by plain ``nn.Sequential`` containers: one forward and one backward pass to the
layers' outputs, per-example norms from the captured activations and output
gradients (the rank-one "ghost norm" for Linear layers, unfolded per-example
gradients or their Gram matrices for Conv2d, whichever is cheaper), and the clipped
sum as one matmul per layer. Other models fall back to Opacus (ghost clipping, or
its hooks where ghost does not apply), or to ``vmap`` (each example's gradient of the
whole model by torch.func) where Opacus would replay a module's whole forward per
example. Sampling (Opacus's DPDataLoader), the noise
(same draws as Opacus's DPOptimizer), the scaling and the accountant are the same on
every path; ``stats["dp-path"]`` says which path ran.

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
from collections.abc import Callable, Mapping
from logging import INFO
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from privacy import quiet_import_opacus

from ._errors import ClientError
from .config import MAX_NOISE_MULTIPLIER, MIN_LOCAL_NOISE_MULTIPLIER, TrainSettings, check
from .tasks import Dataset
from .tasks.inputs import call_args, forward, leaves, take, to_tensors, unsqueeze

GRAD_SAMPLE_MODES = ("fast", "ghost", "hooks", "functorch", "vmap")
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # a task's loss: (output, target) -> batch mean
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
    gradients are computed: ``fast`` (fedshield's one-backward clipping for Sequential
    stacks of Linear / Conv2d and parameter-free layers; falls back to ``ghost`` where
    the model does not allow it), ``ghost`` (Opacus ghost clipping, two backward passes; Linear and
    Embedding layers' per-example norms come without materialising per-example
    gradients, other layers' are materialised for their norms only; falls back to
    ``hooks`` where the model does not allow it), ``hooks`` or ``functorch`` (Opacus's), or ``vmap``
    (fedshield's: each example's gradient of the whole model by ``torch.func``, exact for any model vmap runs;
    taken in place of Opacus's where it would replay a module's whole forward per example, see
    :func:`resolve_grad_sample_mode`).
    """

    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    grad_sample_mode: str = "fast"
    poisson_sampling: bool = True
    accountant: str = "pld"

    def __post_init__(self) -> None:
        z, c, d = self.noise_multiplier, self.max_grad_norm, self.delta
        check(_noise_ok(z), "noise-multiplier",
              f"be a number in [{MIN_LOCAL_NOISE_MULTIPLIER:g}, {MAX_NOISE_MULTIPLIER:g}] (0 adds no noise: no privacy; below "
              f"{MIN_LOCAL_NOISE_MULTIPLIER:g} the accountant cannot charge it; past {MAX_NOISE_MULTIPLIER:g} the accountant overflows and "
              "epsilon no longer changes)", z)
        check(_finite(c) and c > 0, "max-grad-norm",
              "be a finite number > 0 (it bounds each example's influence)", c)
        check(_finite(d) and 0 < d < 1, "delta", "be in (0, 1)", d)
        check(self.grad_sample_mode in GRAD_SAMPLE_MODES, "grad-sample-mode",
              f"be one of {list(GRAD_SAMPLE_MODES)}", self.grad_sample_mode)
        check(isinstance(self.poisson_sampling, bool), "poisson-sampling",
              "be true or false", self.poisson_sampling)
        from privacy import available_accountants

        check(self.accountant in available_accountants(), "accountant", f"be one of {list(available_accountants())}",
              self.accountant)


def private_generator() -> torch.Generator:
    """A CPU generator seeded from the OS's entropy pool: its draws are unknown to the server."""
    return torch.Generator().manual_seed(secrets.randbits(63))


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _noise_ok(z: Any) -> bool:
    """A noise multiplier the accountant can charge: in [MIN_LOCAL_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER]."""
    return _finite(z) and MIN_LOCAL_NOISE_MULTIPLIER <= z <= MAX_NOISE_MULTIPLIER


def resolve_grad_sample_mode(model: nn.Module, requested: str) -> str:
    """The per-example gradient mode that will run for ``model``.

    ``fast`` needs a model :func:`fast_clipping_layers` accepts; otherwise it falls back to what ``ghost``
    resolves to. An Opacus mode becomes ``vmap`` where a module with submodules holds trainable parameters of its
    own and Opacus has no rule for it (the model itself holding a Transformer's positions): Opacus would replay
    that module's whole forward once per example for them (19.9 ms a step against vmap's 11.8 ms, a 2-layer
    Transformer, batch 64), and cannot when it draws dropout; so does a model with trainable parameters in an
    ``nn.ParameterList`` / ``nn.ParameterDict`` (never called: Opacus's hooks never see them), and a model class
    Opacus's hooks already failed on in this process (``_VMAP_FOR``). ``ghost`` needs
    every trainable layer to have an Opacus norm or grad sampler and no parameter shared between layers
    (tied embeddings); otherwise it falls back to ``hooks``. Other modes are returned unchanged.
    """
    if requested == "fast":
        if fast_clipping_layers(model) is not None:
            return "fast"
        requested = "ghost"
    if requested == "vmap" or _hookless(model) in _VMAP_FOR:
        return "vmap"
    if any(parent for _, _, parent in replayed_modules(model)) or _direct_parameters(model):
        return "vmap"
    if requested != "ghost":
        return requested
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


def replayed_modules(model: nn.Module) -> list[tuple[str, list[str], bool]]:
    """``(module, its parameters, whether it has submodules)`` for each module whose own trainable parameters
    Opacus has no per-example rule for: its hooks get their per-example gradients by replaying the module's whole
    forward under vmap, once per example ("the model itself" for a parameter held beside its layers: a
    Transformer's positions)."""
    quiet_import_opacus()
    from opacus.grad_sample import GradSampleModule

    known = set(GradSampleModule.GRAD_SAMPLERS)
    return [(name or "the model itself", [n for n, p in m.named_parameters(recurse=False) if p.requires_grad],
             next(m.children(), None) is not None)
            for name, m in model.named_modules()
            if type(m) not in known and any(p.requires_grad for p in m.parameters(recurse=False))]


def _direct_parameters(model: nn.Module) -> bool:
    """Whether trainable parameters sit in an ``nn.ParameterList`` / ``nn.ParameterDict``: containers never called,
    whose parameters the parent's forward reads directly, so Opacus's hooks give them no per-example gradient."""
    return any(isinstance(m, nn.ParameterList | nn.ParameterDict) and any(p.requires_grad for p in m.parameters())
               for m in model.modules())


_VMAP_FOR: set[tuple] = set()  # models (class, trainable names) Opacus's hooks could not clip: vmap from then on


def _hookless(model: nn.Module) -> tuple:
    return type(model), tuple(n for n, p in model.named_parameters() if p.requires_grad)


def _to_vmap(model: nn.Module, why: str) -> None:
    """Route ``model``'s class to the vmap path from now on, said once in the log."""
    key = _hookless(model)
    if key not in _VMAP_FOR:
        from flwr.common.logger import log

        _VMAP_FOR.add(key)
        log(INFO, "[fedshield] local DP: %s: %s; fedshield's vmap path clips each example's gradient instead",
            type(model).__name__, why)


def data_dependent_state(model: nn.Module, x: Any, batch_size: int = 2,
                         augment: Callable[[Any, torch.Tensor, torch.Generator], tuple] | None = None) -> list[str]:
    """The buffers and parameters a training-mode forward writes differently for two batches of ``x`` (as the
    training loop would feed them, ``augment`` included): a statistic of the data kept in the model (BatchNorm's
    running mean, an embedding's ``max_norm`` rescaling the rows it reads, a data-dependent initialisation). Under
    DP-SGD one example then moves the others' gradients and later steps, and the values leave un-noised, kept on the
    client or sent. What the weights alone write (spectral_norm's vectors) or a counter comes out the same and passes.
    One example is compared with zeros. Nothing is left changed (buffers, parameters, torch's generator, the mode);
    a forward that fails is a ClientError naming it: a model this cannot check is not trained."""
    n = len(leaves(x)[0]) if leaves(x) else 0
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if n == 0 or not state:
        return []
    k = max(1, min(batch_size, n // 2))
    first = take(x, slice(0, k))
    second = take(x, slice(k, 2 * k)) if n >= 2 else tree_map(lambda t: torch.zeros_like(t) if t.any() else
                                                              torch.ones_like(t), first)
    saved = {name: t.detach().clone() for name, t in state.items()}
    sums, mode = [], model.training
    device = next(iter(saved.values())).device

    def checksum() -> dict[str, tuple]:  # (exact for the shapes; float64 sums for the values)
        now = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        return {name: (tuple(t.shape), t.detach().double().sum().item(), t.detach().double().square().sum().item())
                for name, t in now.items()}

    def restore() -> None:
        for name, value in saved.items():
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            now = module._parameters.get(leaf) if leaf in module._parameters else module._buffers.get(leaf)
            if now is not None and now.shape == value.shape and now.dtype == value.dtype:
                now.data.copy_(value)
            elif leaf in module._buffers:  # (a forward that re-registered it at another size: the old one back)
                module._buffers[leaf] = value.clone()

    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            draws = torch.random.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None
            for part in (first, second):
                torch.random.set_rng_state(draws[0])  # (each forward the same random draws: only the data differs)
                if draws[1] is not None:
                    torch.cuda.set_rng_state(draws[1], device)
                if augment is not None:
                    part, _ = augment(part, torch.zeros(len(leaves(part)[0]), dtype=torch.long, device=device),
                                      torch.Generator().manual_seed(0))
                forward(model.train(), part)
                sums.append(checksum())
                restore()
    except Exception as exc:  # noqa: BLE001 - any failure of the user's forward: said, and not trained
        raise ClientError(f"local DP: the model's forward must run on two batches of this node's data before training "
                          f"(to check it keeps no statistic of them). Found {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())[:200]}") from None
    finally:
        with torch.no_grad():
            try:
                restore()
            finally:
                model.train(mode)
    return [name for name in saved if sums[0].get(name) != sums[1].get(name)]


def _replay_error(model: nn.Module) -> ClientError:
    """The one line for a replayed forward that draws random numbers (vmap's "randomness error mode")."""
    where = "; ".join(f"{name} ({', '.join(params)})" for name, params, _ in replayed_modules(model)) or "a module"
    return ClientError(f"local DP: {where}: no Opacus per-example rule, and vmap cannot replay a forward that draws "
                       "random numbers (dropout): hold them in a submodule (nn.Embedding...)")


def _without_grad_sample(model: nn.Module, attr: str = "grad_sample") -> str:
    """The trainable parameters Opacus gave no per-example value (``attr``: what its path keeps per parameter,
    ghost's ``_norm_sample``), for a message."""
    names = [n for n, p in model.named_parameters() if p.requires_grad and getattr(p, attr, None) is None]
    return f"{', '.join(names[:3]) or '?'}{' ...' if len(names) > 3 else ''}"


def _no_grad_sample_error(model: nn.Module, attr: str = "grad_sample") -> ClientError:
    """The one line for Opacus's "Per sample gradient is not initialized": which parameters had none, and why."""
    return ClientError(
        f"local DP: {_without_grad_sample(model, attr)} got no per-example gradient "
        "(Opacus's hooks): call its module in forward (self.pos(ids), not self.pos.weight); freeze unused ones")


# --- fast path: one-backward per-example clipping for Sequential Linear/Conv2d stacks -------------

# Parameter-free layers whose output for one example depends on that example's input only.
_PER_EXAMPLE_LAYERS = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Identity, nn.Flatten, nn.Unflatten,
    nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.AlphaDropout,
)


def _fast_layer_ok(m: nn.Module) -> bool:
    if not m.weight.requires_grad:  # a frozen weight with a trainable bias: not handled here
        return m.bias is None or not m.bias.requires_grad
    if type(m) is nn.Conv2d:
        return m.groups == 1 and m.padding_mode == "zeros" and isinstance(m.padding, tuple)
    return True


def fast_clipping_layers(model: nn.Module) -> list[nn.Module] | None:
    """``model``'s layers in execution order if the fast path can clip it exactly, else None.

    Accepted: plain ``nn.Sequential`` containers (exact type, nested) of ``nn.Linear``,
    ``nn.Conv2d`` (groups 1, zero padding) and parameter-free per-example layers; or a
    bare Linear / Conv2d. No buffers, no layer or parameter used twice. Every trainable
    parameter is then a Linear / Conv2d weight or bias used once per forward, so the
    per-example norms computed from the layers' activations cover all of it.
    """
    if next(model.buffers(), None) is not None:
        return None
    layers: list[nn.Module] = []

    def walk(m: nn.Module) -> bool:
        if type(m) is nn.Sequential:
            return all(walk(child) for child in m)
        if type(m) in (nn.Linear, nn.Conv2d):
            if not _fast_layer_ok(m):
                return False
        elif type(m) not in _PER_EXAMPLE_LAYERS or next(m.parameters(), None) is not None:
            return False
        layers.append(m)
        return True

    if not walk(model):
        return None
    seen: set[int] = set()
    for m in layers:
        if type(m) in (nn.Linear, nn.Conv2d):
            ids = {id(p) for p in m.parameters(recurse=False)}
            if ids & seen:  # a layer run twice, or a parameter tied across layers
                return None
            seen |= ids
    if seen != {id(p) for p in model.parameters()} or not any(_trainable(m) for m in layers):
        return None
    return layers


def _trainable(m: nn.Module) -> bool:
    return type(m) in (nn.Linear, nn.Conv2d) and m.weight.requires_grad


def _bias(m: nn.Module) -> torch.Tensor | None:
    return m.bias if m.bias is not None and m.bias.requires_grad else None


def _clip_factor(norms: torch.Tensor, max_grad_norm: float, scale: float = 1.0) -> torch.Tensor:
    """Each example's factor ``min(1, C / (||grad_i|| + 1e-6))`` (Opacus's), times ``scale``: every path's."""
    c = (max_grad_norm / (norms + 1e-6)).clamp_(max=1.0)
    return c * scale if scale != 1.0 else c


def _row_sq_norms(t: torch.Tensor) -> torch.Tensor:
    """Each example's squared L2 norm over all of ``t`` but the batch dimension (one reduction), in float32 at
    least (a bfloat16 model's norms summed in bfloat16 came out 1.8% low over 150 tensors: clipped past C)."""
    return torch.linalg.vector_norm(t.reshape(len(t), -1), dim=1,
                                    dtype=torch.promote_types(t.dtype, torch.float32)).square()


# The per-layer helpers below keep the number of operations on large tensors small: on a
# shared CPU every such operation is a parallel region whose cost is more than its FLOPs.


class _Linear:
    """Per-example norms and clipped sums of one Linear layer from its input ``a`` and output gradient ``g``."""

    def __init__(self, m: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> None:
        self.m, self.bias = m, _bias(m)
        if a.dim() == 2:  # ghost norm: ||g_i a_i^T||_F^2 = ||g_i||^2 ||a_i||^2
            self.a, self.g, self.psg = a, g, None
        else:  # a sequence dimension: materialise the per-example gradients
            a3, g3 = a.reshape(len(a), -1, a.shape[-1]), g.reshape(len(g), -1, g.shape[-1])
            self.psg = torch.bmm(g3.transpose(1, 2), a3)
            self.g = g3.sum(1)

    def sq_norms(self) -> torch.Tensor:
        gg = _row_sq_norms(self.g)
        n2 = gg * _row_sq_norms(self.a) if self.psg is None else _row_sq_norms(self.psg)
        return n2 + gg if self.bias is not None else n2

    def clipped_sums(self, c: torch.Tensor) -> list[torch.Tensor]:
        gc = self.g * c.unsqueeze(1)
        out = [gc.t().mm(self.a) if self.psg is None else c.unsqueeze(0).mm(self.psg.flatten(1)).view_as(self.m.weight)]
        if self.bias is not None:
            out.append(gc.sum(0))
        return out


def _unfold(a: torch.Tensor, m: nn.Conv2d) -> torch.Tensor:
    """im2col of ``a`` for ``m``: (B, C*kh*kw, L), as ``F.unfold`` (whose CPU kernel is ~20x slower) gives it."""
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = m.kernel_size, m.stride, m.dilation, m.padding
    if ph or pw:
        a = torch.nn.functional.pad(a, (pw, pw, ph, ph))
    v = a.unfold(2, (kh - 1) * dh + 1, sh)[..., ::dh]  # (B, C, Lh, W, kh)
    v = v.unfold(3, (kw - 1) * dw + 1, sw)[..., ::dw]  # (B, C, Lh, Lw, kh, kw)
    b, c, lh, lw = v.shape[:4]
    return v.permute(0, 1, 4, 5, 2, 3).reshape(b, c * kh * kw, lh * lw)


def _conv_per_example_grads(a: torch.Tensor, g: torch.Tensor, m: nn.Conv2d) -> torch.Tensor:
    """Per-example weight gradients of ``m`` (B, O, C*kh*kw), from its input ``a`` and output gradient ``g``.

    Stride 1 and 16+ input channels: one batched matmul per kernel offset on a shifted
    flat view of the padded input (the output gradient is padded to the input's width
    with zeros, so rows never mix), with no im2col copy (2x faster for 32 channels on
    CPU). Otherwise im2col, then one batched matmul (faster for few input channels).
    """
    if m.stride != (1, 1) or a.shape[1] < 16:
        return torch.bmm(g.flatten(2), _unfold(a, m).transpose(1, 2))
    (kh, kw), (dh, dw), (ph, pw) = m.kernel_size, m.dilation, m.padding
    if ph or pw:
        a = torch.nn.functional.pad(a, (pw, pw, ph, ph))
    b, c, hp, wp = a.shape
    lh, lw = g.shape[2:]
    gp = torch.nn.functional.pad(g, (0, wp - lw)).reshape(b, g.shape[1], lh * wp)
    flat = torch.nn.functional.pad(a.reshape(b, c, hp * wp), (0, (kw - 1) * dw))
    outs = []
    for i in range(kh):
        for j in range(kw):
            off = i * dh * wp + j * dw
            outs.append(torch.bmm(gp, flat[:, :, off:off + lh * wp].transpose(1, 2)))  # (B, O, C)
    return torch.stack(outs, 3).reshape(b, g.shape[1], c * kh * kw)


class _Conv2d:
    """Conv2d: materialised per-example gradients, or ghost norms via Gram matrices of the unfolded input."""

    def __init__(self, m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> None:
        self.m, self.bias = m, _bias(m)
        b, o, length = g.shape[0], g.shape[1], g.shape[2] * g.shape[3]
        self.g_sum = g.sum((2, 3)) if self.bias is not None else None  # per-example bias gradients (B, O)
        # Materialising costs O * C*kh*kw per example; the Gram-matrix ghost norm costs L^2.
        if o * m.weight[0].numel() <= length * length:
            self.psg, self.g, self.u = _conv_per_example_grads(a, g, m), None, None
        else:
            self.psg, self.g, self.u = None, g.reshape(b, o, length), _unfold(a, m)  # (B, O, L), (B, C*kh*kw, L)

    def sq_norms(self) -> torch.Tensor:
        if self.psg is not None:
            n2 = _row_sq_norms(self.psg)
        else:  # ||G_i U_i^T||_F^2 = <G_i^T G_i, U_i^T U_i>
            gram_g = torch.bmm(self.g.transpose(1, 2), self.g)
            gram_u = torch.bmm(self.u.transpose(1, 2), self.u)
            n2 = (gram_g * gram_u).sum((1, 2))
        return n2 + _row_sq_norms(self.g_sum) if self.g_sum is not None else n2

    def clipped_sums(self, c: torch.Tensor) -> list[torch.Tensor]:
        w = self.m.weight
        if self.psg is not None:
            out = [c.unsqueeze(0).mm(self.psg.flatten(1)).view_as(w)]
        else:
            out = [torch.einsum("bol,bkl->ok", self.g * c.view(-1, 1, 1), self.u).view_as(w)]
        if self.g_sum is not None:
            out.append(c.unsqueeze(0).mm(self.g_sum).view(-1))
        return out


_FAST_LAYERS = {nn.Linear: _Linear, nn.Conv2d: _Conv2d}


class _Capture:
    """Forward hooks on the trainable layers that record each one's input and output."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.layers = [m for m in layers if _trainable(m)]
        self.records: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook) for m in self.layers]

    def _hook(self, m: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        self.records.append((m, inputs[0], output))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.records = [], []


def clipped_grad_sum(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, max_grad_norm: float, *, scale: float = 1.0,
    _capture: _Capture | None = None, loss_fn: LossFn | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """One forward and one backward pass: the sum over the batch of each example's clipped gradient.

    ``model`` must be one :func:`fast_clipping_layers` accepts (else ClientError).
    Each example's gradient of its loss (``loss_fn``'s batch mean times the batch size; default
    cross-entropy), over all trainable parameters,
    is scaled by ``min(1, C / (||grad_i|| + 1e-6))`` (Opacus's factor). Returns
    ``(sums, loss, norms)``: the summed clipped gradient of each trainable parameter
    in ``model.parameters()`` order (times ``scale``), the batch's mean loss (detached)
    and the per-example gradient norms before clipping. No parameter's ``.grad`` is touched.
    """
    capture = _capture
    if capture is None:
        layers = fast_clipping_layers(model)
        if layers is None:
            raise ClientError("model must be a Sequential stack of Linear / Conv2d and parameter-free layers for "
                              f"fast per-example clipping. Found {type(model).__name__}.")
        capture = _Capture(layers)
    try:
        capture.records.clear()
        logits = forward(model, x)
        records = capture.records
        if len(records) != len(capture.layers) or len({id(m) for m, _, _ in records}) != len(records):
            raise ClientError(f"each trainable layer must run once per forward for fast per-example clipping. "
                              f"Found {len(records)} calls for {len(capture.layers)} layers.")
        loss = (nn.functional.cross_entropy(logits, y, reduction="sum") if loss_fn is None
                else loss_fn(logits, y) * len(y))
        grads = torch.autograd.grad(loss, [out for _, _, out in records])  # no parameter gradients computed
        parts = [_FAST_LAYERS[type(m)](m, a.detach(), g) for (m, a, _), g in zip(records, grads, strict=True)]
    finally:
        if _capture is None:
            capture.remove()
        else:
            capture.records = []
    sq = parts[0].sq_norms()
    for part in parts[1:]:
        sq = sq + part.sq_norms()
    norms = sq.sqrt()
    c = _clip_factor(norms, max_grad_norm, scale)
    by_param: dict[int, torch.Tensor] = {}
    for part in parts:
        for p, total in zip((part.m.weight, part.bias), part.clipped_sums(c.to(part.m.weight.dtype))):
            by_param[id(p)] = total
    sums = [by_param[id(p)] for p in model.parameters() if p.requires_grad]
    return sums, loss.detach() / max(len(y), 1), norms


class FastPrivateTrainer:
    """DP-SGD with fedshield's one-backward clipping; the interface of :class:`PrivateTrainer`.

    Noise, scaling and accounting follow Opacus's DPOptimizer step for step: for each
    trainable parameter in ``model.parameters()`` order, a ``torch.normal`` draw of std
    ``z C`` from ``noise_generator`` is added to the clipped sum and the result divided
    by the expected batch size ``E`` (computed as ``sum / E`` plus the same draw at std
    ``z C / E``), the wrapped SGD steps, and the accountant records one ``(z, q)``
    event. Forward hooks on the trainable layers capture their activations until
    :meth:`close`.
    """

    grad_sample_mode = "fast"

    def __init__(self, model: nn.Module, layers: list[nn.Module], loader: torch.utils.data.DataLoader,
                 settings: TrainSettings, dp: LocalDpSettings, noise_generator: torch.Generator | None,
                 accountant: Any, loss_fn: LossFn | None = None) -> None:
        self.model, self.dp, self.loader, self.loss_fn = model, dp, loader, loss_fn
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=settings.lr, momentum=settings.momentum)
        self.noise_generator, self.accountant = noise_generator, accountant
        self.sample_rate = 1.0 / len(loader)
        self.expected_batch_size = int(len(loader.dataset) * self.sample_rate)  # as Opacus's make_private
        self._capture = _Capture(layers)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward, clipped backward, noisy update; returns the batch's mean loss (detached)."""
        # (sum + N(0, (zC)^2)) / E, computed as sum / E + N(0, (zC / E)^2): the same draws, fewer passes.
        scale = 1.0 / self.expected_batch_size
        sums: list[torch.Tensor | None] = [None] * len(self.params)
        if len(y):
            sums, loss = self._clipped_sums(x, y, scale)
        else:  # Poisson sampling drew no example: the update is noise only
            loss = torch.zeros((), device=self.params[0].device)
        std = self.dp.noise_multiplier * self.dp.max_grad_norm * scale
        for p, total in zip(self.params, sums, strict=True):
            noise = torch.normal(mean=0, std=std, size=p.shape, device=p.device,
                                 generator=self.noise_generator, dtype=p.dtype)
            p.grad = noise if total is None else noise.add_(total)
        self.optimizer.step()
        if self.accountant is not None:
            self.accountant.step(noise_multiplier=self.dp.noise_multiplier, sample_rate=self.sample_rate)
        return loss

    def _clipped_sums(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each trainable parameter's summed clipped gradient times ``scale``, and the batch's mean loss."""
        sums, loss, _ = clipped_grad_sum(self.model, x, y, self.dp.max_grad_norm, scale=scale,
                                         _capture=self._capture, loss_fn=self.loss_fn)
        return sums, loss

    def close(self) -> nn.Module:
        """Remove the hooks and the gradients this trainer set; return the model (never wrapped)."""
        self._capture.remove()
        for p in self.params:
            p.grad = None
        return self.model


def vmap_clipped_grad_sum(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, max_grad_norm: float, *, scale: float = 1.0,
    loss_fn: LossFn | None = None, chunk: int | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """:func:`clipped_grad_sum` for any model vmap runs: each example's gradient (of ``loss_fn`` on a batch of
    one; default cross-entropy) over every trainable parameter by ``vmap(grad)`` of the whole model, ``chunk``
    examples at a time (default: ~256 MB of float32 gradients), clipped by Opacus's factor and summed. A tied
    parameter is one entry (its uses summed, as autograd sums them); dropout draws each example's own mask."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ClientError("model must have a trainable parameter for DP-SGD. Found none.")
    params = {n: p.detach() for n, p in named}
    rest = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    rest.update(model.named_buffers())

    def one(params: dict[str, torch.Tensor], xi: Any, yi: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model, {**params, **rest}, *call_args(unsqueeze(xi)))
        target = yi.unsqueeze(0)
        return nn.functional.cross_entropy(out, target) if loss_fn is None else loss_fn(out, target)

    if not len(y):  # (an empty batch: nothing summed, loss 0, as the fast path)
        return [torch.zeros_like(p) for _, p in named], torch.zeros((), device=y.device), torch.zeros(0, device=y.device)
    per_example = torch.func.vmap(torch.func.grad_and_value(one), in_dims=(None, 0, 0), randomness="different")
    numel = sum(p.numel() for _, p in named)
    chunk = chunk or max(1, 2**26 // max(numel, 1))
    sums = {n: torch.zeros_like(p) for n, p in named}
    losses, norms = [], []
    for start in range(0, len(y), chunk):
        xs, ys = take(x, slice(start, start + chunk)), y[start:start + chunk]
        grads, loss = per_example(params, xs, ys)
        sq = sum(_row_sq_norms(grads[n]) for n, _ in named)
        norm = sq.sqrt()
        c = _clip_factor(norm, max_grad_norm, scale)
        for n, _ in named:
            sums[n].add_(torch.tensordot(c, grads[n].to(c.dtype), dims=1))
        losses.append(loss.detach())
        norms.append(norm)
    return [sums[n] for n, _ in named], torch.cat(losses).mean(), torch.cat(norms)


class VmapPrivateTrainer(FastPrivateTrainer):
    """DP-SGD with :func:`vmap_clipped_grad_sum`; noise, scaling and accounting as :class:`FastPrivateTrainer`."""

    grad_sample_mode = "vmap"

    def _clipped_sums(self, x: torch.Tensor, y: torch.Tensor, scale: float) -> tuple[list[torch.Tensor], torch.Tensor]:
        sums, loss, _ = vmap_clipped_grad_sum(self.model, x, y, self.dp.max_grad_norm, scale=scale,
                                              loss_fn=self.loss_fn)
        return sums, loss


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
        if not len(y):  # Poisson sampling drew no example: noise only, as the hooks path steps it (ghost's and
            params = [p for p in self.module.parameters() if p.requires_grad]  # functorch's forward of an empty
            for p in params:  # batch fails on an embedding)
                p.grad = torch.zeros_like(p)
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            self.optimizer.step()
            for p in params:  # (ghost's zero_grad never clears it: its next batch would find it and fail)
                p.grad_sample = None
            return torch.zeros((), device=y.device)
        loss = self.criterion(forward(self.module, x), y)
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


class _Criterion(nn.Module):
    """A task's batch-mean loss as the criterion module Opacus takes (cross-entropy when there is none)."""

    def __init__(self, loss_fn: LossFn | None) -> None:
        super().__init__()
        self.loss_fn, self.reduction = loss_fn, "mean"

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is None:
            return nn.functional.cross_entropy(output, target, reduction=self.reduction)
        return self.loss_fn(output, target)


def make_private_trainer(
    model: nn.Module, loader: torch.utils.data.DataLoader, settings: TrainSettings,
    dp: LocalDpSettings, *, noise_generator: torch.Generator | None, accountant: Any = None,
    loss_fn: LossFn | None = None,
) -> PrivateTrainer | FastPrivateTrainer:
    """A DP-SGD trainer for ``model`` (SGD with ``settings``' lr and momentum).

    With ``grad_sample_mode = "fast"`` and a model the fast path accepts, a
    :class:`FastPrivateTrainer` over Opacus's Poisson-sampling DPDataLoader (or
    ``loader`` itself without Poisson sampling); otherwise Opacus's PrivacyEngine
    wraps the model. The trainer's ``grad_sample_mode`` says which path runs.
    ``accountant`` (an opacus RDPAccountant) receives one event per step. ``loss_fn`` (a task's batch-mean
    loss; default cross-entropy) must sum over examples: DP-SGD clips each example's share. Raises
    :class:`ClientError` if the model cannot be trained with per-example clipping.
    """
    quiet_import_opacus()
    from opacus import PrivacyEngine
    from opacus.accountants import RDPAccountant
    from opacus.data_loader import DPDataLoader
    from opacus.validators.errors import UnsupportedModuleError

    mode = resolve_grad_sample_mode(model, dp.grad_sample_mode)
    if loss_fn is not None and mode == "ghost":  # ghost clipping needs a criterion with reduction="none"
        mode = "hooks"
    if mode in ("fast", "vmap"):
        fast_loader = DPDataLoader.from_data_loader(loader) if dp.poisson_sampling else loader
        ledger = RDPAccountant() if accountant is None else accountant
        if mode == "vmap":
            return VmapPrivateTrainer(model, [], fast_loader, settings, dp, noise_generator, ledger, loss_fn)
        layers = fast_clipping_layers(model)
        assert layers is not None
        return FastPrivateTrainer(model, layers, fast_loader, settings, dp, noise_generator, ledger, loss_fn)
    engine = PrivacyEngine(accountant=ACCOUNTANT, secure_mode=False)
    if accountant is not None:
        engine.accountant = accountant
    optimizer = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum)
    try:
        out = engine.make_private(
            module=model, optimizer=optimizer, criterion=_Criterion(loss_fn), data_loader=loader,
            noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.max_grad_norm,
            poisson_sampling=dp.poisson_sampling, noise_generator=noise_generator,
            grad_sample_mode=mode,
        )
    except UnsupportedModuleError as exc:
        raise ClientError(
            "model must be compatible with per-example clipping (no BatchNorm, no buffers "
            f"shared across examples), or DP-SGD's bound on one example's influence fails. Found: {exc}"
        ) from None
    except NotImplementedError as exc:  # a trainable layer with buffers (spectral_norm's u): no Opacus rule
        text = " ".join(str(exc).split())
        _to_vmap(model, "Opacus has no per-example rule for a trainable layer with buffers (spectral_norm's vectors)"
                 if "trainable layer with buffers" in text else f"Opacus cannot clip it ({text[:160]})")
        return make_private_trainer(model, loader, settings, dataclasses.replace(dp, grad_sample_mode="vmap"),
                                    noise_generator=noise_generator, accountant=accountant, loss_fn=loss_fn)
    module, dp_opt, *rest = out
    criterion = rest[0] if len(rest) == 2 else _Criterion(loss_fn)
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
        ok = ok and _noise_ok(z) and _finite(q) and 0 < q <= 1
        ok = ok and isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1
        check(ok, f"{where}.history", f"hold [noise_multiplier in [{MIN_LOCAL_NOISE_MULTIPLIER:g}, {MAX_NOISE_MULTIPLIER:g}], "
              "sample_rate in (0, 1], steps >= 1] events", event)
        events.append((float(z), float(q), int(steps)))
    accountant.history = events
    return accountant


def accountant_to_state(accountant: Any) -> dict[str, Any]:
    """The accountant's ledger as plain JSON-ready data."""
    return {"mechanism": accountant.mechanism(),
            "history": [[float(z), float(q), int(s)] for z, q, s in accountant.history]}


def planned_epsilon(accountant_state: Mapping[str, Any] | None, dp: LocalDpSettings, settings: TrainSettings,
                    n: int) -> float:
    """The epsilon (at ``dp.delta``) the ledger would reach after ``train_local_dp`` over ``n`` examples, or
    more: the same steps per epoch and a sample rate of one over them. Under Poisson sampling Opacus's
    DPDataLoader takes ``int(1 / (1 / L))`` steps for ``L = ceil(n / batch)`` batches, one fewer than L for
    some L (93, 99, ...), and the fast trainer records one over its length: planning with L under-counted
    what the ledger was then charged (3.085 planned, 3.101 charged, past a --max-local-epsilon of 3.09)."""
    batches = math.ceil(n / max(1, min(settings.batch_size, n)))
    if dp.poisson_sampling:
        batches = max(1, int(1 / (1 / batches)))  # len(DPDataLoader): its sample rate is 1 / batches
    accountant = accountant_from_state(accountant_state)
    accountant.history.append((dp.noise_multiplier, 1.0 / batches, settings.local_epochs * batches))
    return ledger_epsilon(accountant.history, dp)


def ledger_epsilon(history: list[tuple[float, float, int]], dp: LocalDpSettings) -> float:
    """Epsilon at ``dp.delta`` of a ledger's ``(noise_multiplier, q, steps)`` events, composed by ``dp.accountant``."""
    from privacy import PrivacyEvent, epsilon_of

    events = [PrivacyEvent(sampling_rate=q, noise_multiplier=z, steps=int(n)) for z, q, n in history]
    return epsilon_of(events, dp.delta, dp.accountant)


def train_local_dp(
    model: nn.Module, data: Dataset, settings: TrainSettings, dp: LocalDpSettings,
    generator: torch.Generator | None, accountant_state: Mapping[str, Any] | None = None,
    loss_fn: LossFn | None = None, augment: Callable[[Any, torch.Tensor, torch.Generator], tuple] | None = None,
) -> tuple[nn.Module, dict[str, float], dict[str, Any]]:
    """DP-SGD for ``settings.local_epochs`` epochs over ``data``; trains ``model`` in place.

    ``augment(x, y, generator)`` (a task's ``augment``, checked) transforms each sampled batch before its step,
    drawing from ``generator``.
    ``generator`` (a CPU torch generator) drives the Poisson sampling and seeds the
    noise, so a seeded call is reproducible (tests); ``None`` takes
    :func:`private_generator`, which a real client must use (see the module docstring:
    a seed the server knows voids the guarantee). ``accountant_state`` is the state
    returned by this client's previous call (``None`` for a first call).

    Returns ``(model, stats, accountant_state)``: the same model object with plain
    parameters (no Opacus hooks or attributes; parameter order unchanged); stats
    ``train-loss``, ``train-time-s``, ``epsilon`` (all steps so far, at ``dp.delta``),
    ``dp-steps`` (this call), ``dp-sample-rate`` and ``dp-path`` (a string: the
    per-example clipping that ran, ``fast``, ``ghost``, ``hooks``, ``functorch`` or ``vmap``);
    and the updated ledger.
    """
    if len(data) == 0:
        raise ClientError("data must hold at least one example for DP-SGD. Found 0.")
    device = next(model.parameters()).device
    x, y = to_tensors(data.x, device), to_tensors(data.y, device)
    renorm = next((n for n, m in model.named_modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)
                   and m.max_norm is not None), None)
    if renorm is not None:  # (its forward rescales, in place, the rows each batch reads: a change no noise covers)
        raise ClientError(f"local DP: embedding {renorm!r} renormalises the rows each batch reads (max_norm), in place "
                          "and outside DP-SGD's noise: drop max_norm for local DP")
    written = data_dependent_state(model, x, min(settings.batch_size, len(y)), augment)
    if written:  # refused before anything is trained or charged
        more = f" (and {len(written) - 1} more)" if len(written) > 1 else ""
        raise ClientError(f"local DP: {written[0]!r}{more} is written from each batch in the forward (a statistic of "
                          "the data, as BatchNorm's): one example would move the others' gradients, outside DP-SGD's "
                          "bound, kept or sent: compute it outside the forward or drop it")
    accountant = accountant_from_state(accountant_state)
    generator = private_generator() if generator is None else generator
    loader = torch.utils.data.DataLoader(  # batches of example indices (one gather a batch, named inputs alike)
        torch.utils.data.TensorDataset(torch.arange(len(y))), batch_size=min(settings.batch_size, len(y)),
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
                                       accountant=accountant, loss_fn=loss_fn)
        retry = False
        try:
            for _ in range(settings.local_epochs):
                for (index,) in trainer.loader:
                    index = index.to(device)
                    xb, yb = take(x, index), y[index]
                    if augment is not None and len(yb):  # each example transformed on its own (Task.augment)
                        xb, yb = augment(xb, yb, generator)
                    loss = trainer.step(xb, yb)
                    steps += 1
                    if len(yb):  # Poisson sampling can draw an empty batch: noise only
                        total += loss.item() * len(yb)
                        seen += len(yb)
        except RuntimeError as exc:
            if "mutate a captured Tensor" in str(exc):  # vmap's: a forward writing a buffer in place
                raise ClientError("local DP: the model's forward writes a tensor it holds in place (a counter or "
                                  "statistic), which vmap's per-example gradients cannot run: compute it outside the "
                                  "forward, or drop it") from None
            if "randomness error mode" not in str(exc):
                raise
            raise _replay_error(model) from None
        except (ValueError, AttributeError) as exc:
            # (hooks: "Per sample gradient is not initialized"; ghost: a parameter without "_norm_sample")
            attr = "_norm_sample" if "_norm_sample" in str(exc) else "grad_sample"
            if attr == "grad_sample" and "Per sample gradient is not initialized" not in str(exc):
                raise
            if steps or trainer.grad_sample_mode == "vmap":  # (a step taken: its update and charge stand)
                raise _no_grad_sample_error(model, attr) from None
            # a parameter read directly (self.pos.weight), never through its module: Opacus's hooks see no use of it.
            # Nothing was stepped or charged (Opacus checks before it adds noise): the call starts again on vmap
            retry = True
            _to_vmap(model, f"{_without_grad_sample(model, attr)} got no per-example gradient from Opacus's hooks "
                     "(read directly, not through its module's forward)")
        finally:
            model = trainer.close()
    if retry:
        return train_local_dp(model, data, settings, dp, generator, accountant_state, loss_fn, augment)
    stats = {
        "train-loss": total / max(seen, 1),
        "train-time-s": time.perf_counter() - start,
        "epsilon": ledger_epsilon(accountant.history, dp),
        "dp-steps": float(steps),
        "dp-sample-rate": 1.0 / len(loader),
        "dp-path": trainer.grad_sample_mode,
    }
    return model, stats, accountant_to_state(accountant)


__all__ = [
    "GRAD_SAMPLE_MODES",
    "FastPrivateTrainer",
    "LocalDpSettings",
    "PrivateTrainer",
    "VmapPrivateTrainer",
    "accountant_from_state",
    "accountant_to_state",
    "clipped_grad_sum",
    "fast_clipping_layers",
    "ledger_epsilon",
    "make_private_trainer",
    "private_generator",
    "replayed_modules",
    "resolve_grad_sample_mode",
    "train_local_dp",
    "vmap_clipped_grad_sum",
]
