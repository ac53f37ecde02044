"""Several clients' local updates stepped together: their parameters stacked, one
``torch.func.vmap`` of ``functional_call`` per step (docs/BENCHMARKS.md, "Several
clients stepped together").

On a GPU a client's step at the paper's batch sizes is bound by launching kernels, not
by arithmetic; stepping G clients in one call launches each kernel once for all of them.
Each client keeps everything that makes its update its own:

- its batches and augmentation, drawn from its own generator in the order
  :func:`common.training.run_steps` draws them (a client's stream of batches,
  :func:`common.training.batch_stream`);
- its dropout masks, drawn from a generator seeded as the lone path seeds the global one
  (``LocalJob`` calls ``torch.manual_seed(seed)``), in the order the forward pass uses them;
- its BatchNorm running statistics, updated outside the vmapped call from the batch
  statistics the call returns (``vmap`` refuses the in-place update BatchNorm does);
- its momentum buffers, and its loss's own tensors (a client's Q: the keyword tensors
  of a ``functools.partial`` loss, stacked).

Clients whose batches differ in size at a step (an epoch's last batch, a client with
fewer samples) step in one call per size; a client whose epochs are done stops. The
update is the lone one up to floating-point summation order (a vmapped convolution or
matrix product sums in another order): tests/test_stacked_training.py states the
tolerance. A simulation's node serves it a group of clients with ``stacked-clients``
(:mod:`fedefc_client.client_group`). On the CPU it is slower than the clients one
after another (docs/BENCHMARKS.md), so that is 0, one client per message, by default.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, replace_all_batch_norm_modules_, vmap

from .training import LossFn, SGDSettings, TrainingSet, TrainStats, batch_stream

_DROPOUTS = (nn.Dropout, nn.Dropout2d)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


class NotStackable(ValueError):
    """These clients' updates cannot be stepped together; the message says why."""


@dataclass
class ClientRun:
    """One client's local update: its model (trained in place), data, loss, batch
    generator and the seed of its dropout masks."""

    model: nn.Module
    data: TrainingSet
    loss_fn: LossFn
    generator: torch.Generator
    dropout_seed: int


def loss_parts(loss_fn: LossFn) -> tuple[object, dict[str, torch.Tensor]]:
    """(the function, its per-client tensors): a ``functools.partial`` whose keywords are
    tensors (``partial(forward_corrected_loss, q=Q)``) or a plain function of (logits,
    labels)."""
    if isinstance(loss_fn, functools.partial):
        if loss_fn.args or not all(isinstance(v, torch.Tensor)
                                   for v in loss_fn.keywords.values()):
            raise NotStackable(f"the loss {loss_fn!r} binds more than tensor keywords")
        return loss_fn.func, dict(loss_fn.keywords)
    return loss_fn, {}


class _MaskedDropout(nn.Module):
    """Dropout by a mask given per call (already scaled by 1 / (1 - p)), as the buffer
    ``mask`` that ``functional_call`` substitutes."""

    def __init__(self, p: float, feature: bool):
        super().__init__()
        self.p, self.feature = p, feature
        self.register_buffer("mask", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask

    def mask_shape(self, x_shape: torch.Size) -> tuple[int, ...]:
        """The noise shape PyTorch draws: (N, C, 1, ...) for feature dropout, else x's."""
        if self.feature:
            return tuple(x_shape[:2]) + (1,) * (len(x_shape) - 2)
        return tuple(x_shape)


class _StackedModel:
    """The functional twin of a client model: BatchNorm on batch statistics (each
    layer's (mean, unbiased variance) returned beside the loss), dropout by given masks."""

    def __init__(self, model: nn.Module):
        self.twin = copy.deepcopy(model)
        self.norms: list[tuple[str, nn.Module]] = []
        self.dropouts: list[tuple[str, _MaskedDropout]] = []
        self._sink: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, module in list(self.twin.named_modules()):
            if isinstance(module, _DROPOUTS):
                if module.p <= 0 or module.p >= 1:
                    raise NotStackable(f"dropout {name} has p = {module.p}")
                masked = _MaskedDropout(module.p, isinstance(module, nn.Dropout2d))
                self._replace(name, masked)
                self.dropouts.append((name, masked))
            elif isinstance(module, _NORMS):
                if not module.track_running_stats or module.momentum is None:
                    raise NotStackable(f"BatchNorm {name} has no running statistics to "
                                       "update with a momentum")
                self.norms.append((name, module))
                module.register_forward_pre_hook(
                    lambda _m, inputs, n=name: self._record_stats(n, inputs[0]))
            elif isinstance(module, nn.Dropout1d | nn.Dropout3d | nn.AlphaDropout):
                raise NotStackable(f"{name} ({type(module).__name__}) is not served")
        replace_all_batch_norm_modules_(self.twin)
        self.twin.train()
        known = {f"{n}.mask" for n, _ in self.dropouts}
        extra = [n for n, _ in self.twin.named_buffers() if n not in known]
        if extra:
            raise NotStackable(f"the model keeps buffers other than BatchNorm's: {extra}")
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.order = [n for n, _ in self.dropouts]  # call order: set by :meth:`shapes`

    def _replace(self, name: str, module: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(self.twin.get_submodule(parent) if parent else self.twin, child, module)

    def _record_stats(self, name: str, x: torch.Tensor) -> None:
        """A BatchNorm layer's batch mean and unbiased variance, as it updates its
        running statistics with them."""
        dims = [d for d in range(x.dim()) if d != 1]
        self._sink[name] = (x.mean(dims).detach(), x.var(dims, correction=1).detach())

    def shapes(self, model: nn.Module, x: torch.Tensor) -> list[tuple[int, ...]]:
        """The dropout masks' shapes for a batch like ``x``, in call order (one forward
        of ``model`` in eval mode, recorded)."""
        shapes: dict[str, torch.Size] = {}
        modules = dict(model.named_modules())
        order: list[str] = []

        def record(name: str, inputs: tuple[torch.Tensor, ...]) -> None:
            shapes[name] = inputs[0].shape
            order.append(name)

        hooks = [modules[n].register_forward_pre_hook(
            lambda _m, i, n=n: record(n, i)) for n, _ in self.dropouts]
        was = model.training
        try:
            model.eval()
            with torch.no_grad():
                model(x[:1])
        finally:
            model.train(was)
            for h in hooks:
                h.remove()
        masked = dict(self.dropouts)
        self.order = order
        return [(len(x),) + masked[n].mask_shape(shapes[n])[1:] for n in order]

    def dropout_p(self, i: int) -> float:
        """The probability of the ``i``-th dropout layer a forward pass calls."""
        return dict(self.dropouts)[self.order[i]].p

    def loss(self, loss_of, params, masks, x, y, extra):
        """One client's loss and (loss, correct count, batch statistics): the function
        ``vmap(grad(..., has_aux=True))`` maps over the clients."""
        self._sink.clear()
        buffers = {f"{n}.mask": m for n, m in zip(self.order, masks)}
        logits = functional_call(self.twin, (params, buffers), (x,))
        loss = loss_of(logits, y, **extra)
        correct = (logits.argmax(1) == y).sum()
        stats = tuple(t for n, _ in self.norms for t in self._sink[n])
        self._sink.clear()
        return loss, (loss.detach(), correct, stats)


def _check(runs: list[ClientRun], settings: SGDSettings) -> tuple[object, list[str]]:
    """The shared loss function and the keyword names; :class:`NotStackable` otherwise."""
    if settings.precision != "fp32":
        raise NotStackable(f"precision {settings.precision!r} (only fp32 is stepped together)")
    parts = [loss_parts(r.loss_fn) for r in runs]
    funcs = {id(f) for f, _ in parts}
    keys = {tuple(sorted(kw)) for _, kw in parts}
    if len(funcs) > 1 or len(keys) > 1:
        raise NotStackable("the clients' losses differ")
    kinds = {type(r.model) for r in runs}
    if len(kinds) > 1:
        raise NotStackable(f"the clients' models differ: {sorted(k.__name__ for k in kinds)}")
    return parts[0][0], list(keys.pop())


def train_stacked(runs: list[ClientRun], settings: SGDSettings) -> list[TrainStats]:
    """Each run's local SGD (:func:`common.training.train` with its loss), stepped
    together; every model is left trained, as the lone update leaves it."""
    loss_of, keys = _check(runs, settings)
    g = len(runs)
    device = runs[0].data.x.device
    stacked = _StackedModel(runs[0].model)
    params = {n: torch.stack([dict(r.model.named_parameters())[n].detach() for r in runs])
              for n in stacked.names}
    extra = {k: torch.stack([loss_parts(r.loss_fn)[1][k] for r in runs]) for k in keys}
    running = {n: [torch.stack([getattr(r.model.get_submodule(n), b).detach().clone()
                                for r in runs]) for b in ("running_mean", "running_var")]
               for n, _ in stacked.norms}
    momentum = {n: torch.zeros_like(p) for n, p in params.items()}
    started = torch.zeros(g, dtype=torch.bool, device=device)
    mask_gens = [torch.Generator(device=device).manual_seed(r.dropout_seed) for r in runs]
    step_fn = vmap(grad(functools.partial(stacked.loss, loss_of), has_aux=True))
    streams = [batch_stream(r.data, settings, r.generator) for r in runs]
    loss_sums = torch.zeros(g, device=device)
    steps = [0] * g
    correct = torch.zeros((g, settings.epochs), dtype=torch.long, device=device)
    seen = np.zeros((g, settings.epochs), dtype=np.int64)
    shapes: dict[int, list[tuple[int, ...]]] = {}
    live = list(range(g))
    while live:
        pending = {}
        for c in live:
            nxt = next(streams[c], None)
            if nxt is not None:
                pending[c] = nxt
        live = list(pending)
        by_size: dict[int, list[int]] = {}
        for c in live:
            by_size.setdefault(len(pending[c][2]), []).append(c)
        for size, group in by_size.items():
            if size not in shapes:
                shapes[size] = stacked.shapes(runs[0].model, pending[group[0]][1])
            masks = [torch.stack([_mask(shape, stacked.dropout_p(i), mask_gens[c])
                                  for c in group]) for i, shape in enumerate(shapes[size])]
            sel = torch.as_tensor(group, device=device)
            whole = len(group) == g
            sub = params if whole else {n: p.index_select(0, sel) for n, p in params.items()}
            x = torch.stack([pending[c][1] for c in group])
            y = torch.stack([pending[c][2] for c in group])
            ext = {k: v if whole else v.index_select(0, sel) for k, v in extra.items()}
            grads, (loss, hits, stats) = step_fn(sub, masks, x, y, ext)
            _sgd(params, momentum, started, grads, sel, whole, settings)
            _update_running(running, stacked, stats, sel, whole)
            loss_sums.index_add_(0, sel, loss)
            epochs = torch.as_tensor([pending[c][0] for c in group], device=device)
            correct.index_put_((sel, epochs), hits, accumulate=True)
            for c in group:
                seen[c, pending[c][0]] += size
                steps[c] += 1
    _write_back(runs, stacked, params, running, steps)
    out, correct = [], correct.cpu().numpy()
    for c in range(g):
        accs = [correct[c, e] / seen[c, e] for e in range(settings.epochs) if seen[c, e]]
        out.append(TrainStats(mean_loss=float(loss_sums[c]) / max(steps[c], 1),
                              mean_accuracy=float(np.mean(accs)) if accs else 0.0))
    return out


def _mask(shape: tuple[int, ...], p: float, generator: torch.Generator) -> torch.Tensor:
    """The client's next dropout mask, drawn as PyTorch's dropout draws its noise."""
    return torch.empty(shape, device=generator.device).bernoulli_(
        1 - p, generator=generator).div_(1 - p)


@torch.no_grad()
def _sgd(params, momentum, started, grads, sel, whole, s: SGDSettings) -> None:
    """:class:`common.training.SGD`'s step on the rows of the clients ``sel``."""
    first = ~(started if whole else started.index_select(0, sel))
    for n, p in params.items():
        row = p if whole else p.index_select(0, sel)
        g = grads[n]
        if s.weight_decay != 0:
            g = g.add(row, alpha=s.weight_decay)
        if s.momentum != 0:
            buf = momentum[n] if whole else momentum[n].index_select(0, sel)
            fresh = first.view(-1, *([1] * (g.dim() - 1)))
            g = torch.where(fresh, g, buf.mul(s.momentum).add(g))
            momentum[n].index_copy_(0, sel, g)
        p.index_copy_(0, sel, row.add(g, alpha=-s.lr))
    started.index_fill_(0, sel, True)


@torch.no_grad()
def _update_running(running, stacked: _StackedModel, stats, sel, whole) -> None:
    """BatchNorm's running statistics: (1 - m) old + m batch, per client."""
    for k, (name, module) in enumerate(stacked.norms):
        m = module.momentum
        for slot, batch in zip(running[name], stats[2 * k: 2 * k + 2]):
            old = slot if whole else slot.index_select(0, sel)
            slot.index_copy_(0, sel, old.mul(1 - m).add(batch, alpha=m))


@torch.no_grad()
def _write_back(runs, stacked: _StackedModel, params, running, steps) -> None:
    """Each client's trained parameters and statistics into its own model."""
    for c, r in enumerate(runs):
        named = dict(r.model.named_parameters())
        for n in stacked.names:
            named[n].copy_(params[n][c])
        for name, _ in stacked.norms:
            bn = r.model.get_submodule(name)
            bn.running_mean.copy_(running[name][0][c])
            bn.running_var.copy_(running[name][1][c])
            bn.num_batches_tracked += steps[c]
