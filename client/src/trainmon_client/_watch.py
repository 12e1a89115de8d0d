"""Per-layer watching: ``Run.watch(model, optimizer, every=N)``.

Imported only when called, because it needs torch; the rest of the client never imports it.

On every ``every``-th optimizer step (optimizer step hooks, torch >= 2.0), for each module that
owns parameters (a *layer*, named by its path in ``model.named_modules()``):

- grad L2 norm, mean and standard deviation over all its gradient elements;
- weight L2 norm;
- update ratio ``||w_after - w_before|| / ||w_before||``. The weights are copied before the
  step (one batched ``torch._foreach_mul``). With ``exact_update=False`` the ratio is
  ``lr * ||g|| / ||w||`` instead, exact for plain SGD and only a proxy for Adam-like optimizers.

Every ``quantiles_every`` steps, the distribution of each layer's gradient values (min, p25,
median, p75, p95, p99, max; ``torch.quantile`` on at most 65,536 evenly strided elements).
With ``activations=True``, forward hooks record each layer's output mean, standard deviation
and dead-unit share (units never above 0 in the batch) on watched steps.

All statistics are computed on the device with batched kernels and stacked into one tensor.
On a CUDA device that tensor is copied to pinned host memory asynchronously and sent once the
copy has landed (:mod:`trainmon_client._device`): no host-device synchronisation at all. The
index tensors the reductions need are built once per device, and the quantiles come from a
sort and a gather at positions computed on the host (``torch.quantile`` checks its ``q`` on
the device, which synchronises). The watcher times itself. When its cost exceeds ``budget``
of the wall time since the previous watched step, it doubles ``every``.

The watcher knows its run only as a :class:`LayerSink`: it hands each check's table to
``send_layer_table`` and counts what it refuses or fails at; ``Run`` implements it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Protocol

import torch

from trainmon_client import _protocol as P
from trainmon_client._device import Tally

log = logging.getLogger("trainmon_client")

STATS = P.LAYER_STATS
QUANTILES = P.LAYER_QUANTILES
QUANTILE_CODE0 = P.QUANTILE_CODE0
MAX_SAMPLE = 65_536


class LayerSink(Tally, Protocol):
    """Where a :class:`Watcher` sends its checks (``Run`` implements it)."""

    def send_layer_table(
        self,
        step: int,
        names: list[str],
        codes: list[int],
        table: Any,
        checks_total: int,
        seconds_total: float,
    ) -> None:
        """Send one check: ``table`` is ``[len(names), len(codes)]`` (a tensor, on any device).

        ``step``: the optimizer step; ``checks_total`` and ``seconds_total``: the checks so far
        (this one included) and their cumulative cost.
        """


class Watcher:
    """Handle returned by :meth:`Run.watch`; :meth:`remove` detaches every hook.

    Attributes:
        sink: where the checks go (the run).
    """

    def __init__(
        self,
        sink: LayerSink,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        every: int,
        quantiles_every: int,
        activations: bool,
        exact_update: bool,
        budget: float,
        max_layers: int,
    ) -> None:
        self.sink = sink
        self.every = every
        self.quantiles_every = quantiles_every
        self.exact_update = exact_update
        self.budget = budget
        self.layers: list[tuple[str, list[torch.nn.Parameter]]] = []
        for name, module in model.named_modules():
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if params:
                self.layers.append((name or "model", params))
        if len(self.layers) > max_layers:
            sink.count_refused(len(self.layers) - max_layers)
            self.layers = self.layers[:max_layers]
        self.params: list[torch.Tensor] = [p for _, ps in self.layers for p in ps]
        self.layer_of = [i for i, (_, ps) in enumerate(self.layers) for _ in ps]
        self.optimizer = optimizer
        self.enabled = True
        """Set False to pause the checks (the hooks stay, and return at once)."""
        self.steps = 0
        self.checks = 0
        self.seconds_total = 0.0
        self._watching = False
        self._before: list[torch.Tensor] | None = None
        self._grad_stats: torch.Tensor | None = None
        self._t_last = time.perf_counter()
        self._cost = 0.0
        self._acts: dict[int, torch.Tensor] = {}
        self._consts: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._positions: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}
        self._handles = [
            optimizer.register_step_pre_hook(self._pre),
            optimizer.register_step_post_hook(self._post),
        ]
        if activations:
            index = {name: i for i, (name, _) in enumerate(self.layers)}
            for name, module in model.named_modules():
                i = index.get(name or "model")
                if i is not None:
                    self._handles.append(module.register_forward_hook(self._forward_hook(i)))

    def remove(self) -> None:
        """Detach the hooks; the model and optimizer run as if never watched."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---------------------------------------------------------------------------- hooks

    def _forward_hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            if not self._watching_next() or not isinstance(output, torch.Tensor):
                return
            with torch.no_grad():
                out = output.detach().float()
                flat = out.reshape(-1, out.shape[-1]) if out.dim() > 1 else out.reshape(1, -1)
                dead = (flat.amax(dim=0) <= 0).float().mean()
                self._acts[layer] = torch.stack([out.mean(), out.std(), dead])

        return hook

    def _watching_next(self) -> bool:
        """Whether the coming optimizer step is a watched one (forward hooks ask this)."""
        return self.enabled and (self.steps + 1) % self.every == 0

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.steps += 1
        self._watching = self.enabled and self.steps % self.every == 0
        if not self._watching:
            return
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                self._grad_stats = self._gradient_stats()
                if self.exact_update:
                    self._before = list(torch._foreach_mul(self.params, 1.0))
        except Exception:
            self.sink.count_internal_error()
            log.debug("trainmon_client: watch() failed before the step", exc_info=True)
            self._watching = False
        self._cost += time.perf_counter() - t0

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._watching:
            return
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                self._finish_check()
        except Exception:
            self.sink.count_internal_error()
            log.debug("trainmon_client: watch() failed after the step", exc_info=True)
        finally:
            self._before = None
            self._grad_stats = None
            self._acts = {}
            self._watching = False
        self._cost += time.perf_counter() - t0
        now = time.perf_counter()
        cost, self._cost = self._cost, 0.0
        self.seconds_total += cost
        self.checks += 1
        elapsed = now - self._t_last
        self._t_last = now
        if elapsed > 0 and cost / elapsed > self.budget and self.every < 1 << 20:
            self.every *= 2
            log.info(
                "trainmon: watch() cost %.2f %% of wall time; now every %d steps",
                100 * cost / elapsed,
                self.every,
            )

    # ---------------------------------------------------------------------------- statistics

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer index per parameter, element count per parameter) on ``device``, cached.

        Built once per device, through pinned memory (see :func:`to_device`).
        """
        consts = self._consts.get(device)
        if consts is None:
            idx = to_device(self.layer_of, torch.int64, device)
            counts = to_device([float(p.numel()) for p in self.params], torch.float32, device)
            consts = self._consts[device] = (idx, counts)
        return consts

    def _gradient_stats(self) -> torch.Tensor:
        """[layers, 3]: squared grad norm, grad sum, element count (on the device)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        device = grads[0].device
        idx, counts = self._constants(device)
        sq = torch.stack(torch._foreach_norm(grads)).float() ** 2
        sums = torch.stack([g.sum() for g in grads]).float()
        per_param = torch.stack([sq, sums, counts], dim=1)
        out = torch.zeros(len(self.layers), 3, device=device)
        return out.index_add_(0, idx, per_param)

    def _finish_check(self) -> None:
        g = self._grad_stats
        assert g is not None
        device = g.device
        idx, _ = self._constants(device)
        nl = len(self.layers)
        w_sq = torch.stack(torch._foreach_norm(self.params)).float() ** 2
        w_sq = torch.zeros(nl, device=device).index_add_(0, idx, w_sq)
        grad_norm = g[:, 0].sqrt()
        n = g[:, 2].clamp(min=1)
        mean = g[:, 1] / n
        std = (g[:, 0] / n - mean**2).clamp(min=0).sqrt()
        weight_norm = w_sq.sqrt()
        if self._before is not None:
            delta = torch._foreach_sub(self.params, self._before)
            d_sq = torch.stack(torch._foreach_norm(delta)).float() ** 2
            d_sq = torch.zeros(nl, device=device).index_add_(0, idx, d_sq)
            before_sq = torch.stack(torch._foreach_norm(self._before)).float() ** 2
            before_sq = torch.zeros(nl, device=device).index_add_(0, idx, before_sq)
            update = d_sq.sqrt() / before_sq.sqrt().clamp(min=1e-30)
        else:
            lr = self.optimizer.param_groups[0]["lr"]  # a float (a tensor under capturable)
            update = grad_norm * lr / weight_norm.clamp(min=1e-30)
        columns = [grad_norm, mean, std, weight_norm, update]
        codes = [
            STATS[k] for k in ("grad_norm", "grad_mean", "grad_std", "weight_norm", "update_ratio")
        ]
        if self._acts:
            acts = torch.full((nl, 3), math.nan, device=device)
            for layer, v in self._acts.items():
                acts[layer] = v.to(device)
            columns += [acts[:, 0], acts[:, 1], acts[:, 2]]
            codes += [STATS["activation_mean"], STATS["activation_std"], STATS["dead_ratio"]]
        if self.quantiles_every and self.checks % max(1, self.quantiles_every // self.every) == 0:
            rows = []
            for _, params in self.layers:
                grads = [p.grad.reshape(-1) for p in params if p.grad is not None]
                flat = torch.cat(grads) if grads else torch.empty(0, device=device)
                if flat.numel() > MAX_SAMPLE:
                    flat = flat[:: flat.numel() // MAX_SAMPLE + 1]
                rows.append(
                    self._quantiles(flat)
                    if flat.numel()
                    else torch.full((len(QUANTILES),), math.nan, device=device)
                )
            qs = torch.stack(rows)
            columns += [qs[:, i] for i in range(len(QUANTILES))]
            codes += [QUANTILE_CODE0 + i for i in range(len(QUANTILES))]
        table = torch.stack(columns, dim=1)  # [layers, codes], still on the device
        self.sink.send_layer_table(
            self.steps,
            [name for name, _ in self.layers],
            codes,
            table,
            self.checks + 1,
            self.seconds_total,
        )

    def _quantiles(self, values: torch.Tensor) -> torch.Tensor:
        """:data:`QUANTILES` of ``values`` (shape ``[n]``), as ``torch.quantile`` computes them.

        Sorts on the device and interpolates linearly between the sorted elements at
        ``floor(q * (n - 1))`` and the next one; the positions are computed on the host and
        cached per ``(n, device)``. ``torch.quantile`` itself validates ``q`` on the device,
        which synchronises. NaN sorts last, so a NaN gradient shows in the top quantiles.

        Returns:
            float32 tensor of shape ``[len(QUANTILES)]`` on ``values``' device.
        """
        s = values.float().sort().values
        n = s.numel()
        key = (n, s.device)
        positions = self._positions.get(key)
        if positions is None:
            lo = [math.floor(q * (n - 1)) for q in QUANTILES]
            hi = [min(i + 1, n - 1) for i in lo]
            frac = [q * (n - 1) - i for q, i in zip(QUANTILES, lo)]  # noqa: B905 (3.9)
            positions = (
                to_device(lo, torch.int64, s.device),
                to_device(hi, torch.int64, s.device),
                to_device(frac, torch.float32, s.device),
            )
            if len(self._positions) < 4 * len(self.layers) + 16:
                self._positions[key] = positions
        lo_t, hi_t, frac_t = positions
        a = s[lo_t]
        return a + (s[hi_t] - a) * frac_t


def to_device(values: list[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host ``values`` on ``device``, without a host-device synchronisation.

    A copy from pageable host memory waits for the device's queued work (CUDA runtime API,
    "API synchronization behavior"); the values go through a pinned buffer and a
    ``non_blocking`` copy instead (the caching host allocator keeps the buffer alive until
    the copy has run).
    """
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
