"""``trainmon-run`` inside each Python process: training steps from public PyTorch APIs.

What it does inside each Python process it starts: report training steps from hooks on public
PyTorch APIs, with no change to the program's code.

:func:`install` runs from ``trainmon-run``'s ``sitecustomize`` before the program's first line.
It imports nothing but the standard library: it adds an import hook that waits for ``torch``
(and a few frameworks) and patches them when, and only if, the program imports them. The run
itself (:func:`trainmon_client.init`) starts at the process's first optimizer step or
evaluation pass, with the process's start time, so that auxiliary processes (the ``torchrun``
agent, DataLoader workers, compile workers) never open one, and start-up still counts from the
process's start. What is hooked, and what each hook reports (:class:`Instrumenter`):

============== ============================================================ ===============
hook           PyTorch API                                                  reports
============== ============================================================ ===============
optimizer      ``torch.optim.optimizer.register_optimizer_step_pre_hook``   the step (one
               and ``..._post_hook`` (global: every ``Optimizer``)          ``log()`` each),
                                                                            ``lr``
backward       ``torch.autograd.backward`` (``Tensor.backward`` calls it);   ``loss``
               ``torch.amp.GradScaler.scale`` (to report the unscaled loss)
clip_grad_norm ``torch.nn.utils.clip_grad_norm_``                           ``grad_norm``
dataloader     ``torch.utils.data.DataLoader.__iter__`` (each ``next()``     ``data_time``,
               timed)                                                       ``samples``,
                                                                            ``evaluation``
checkpoint     ``torch.save``, ``torch.load``,                              checkpoints and
               ``torch.distributed.checkpoint.save/async_save/load``,       restores
               ``accelerate.Accelerator.save_state/load_state``
frameworks     the Hugging Face ``Trainer``, Lightning (its entry point),   their adapters
               and the other adapters' frameworks: detected, and their      instead
               adapter reports instead of the hooks above
============== ============================================================ ===============

Every value stays where PyTorch put it: the loss and the gradient norm are the device tensors
``backward()`` and ``clip_grad_norm_`` saw, handed to :meth:`Run.log`, which copies them to the
host without a synchronisation (:mod:`trainmon_client._device`). A hook never raises into the
program: its failures are counted (:meth:`Run.count_internal_error`) and the hook goes on; it
never changes an argument or a result. Inside ``torch.compile``'s tracing every hook passes
straight through (``torch.compiler.is_compiling()``).

Why this module is one module over 500 lines: the hooks share one state (the step in progress)
that each reads and resets; split, each part would reach into the others' attributes.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import time
import weakref
from collections.abc import Mapping
from itertools import islice
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

log = logging.getLogger("trainmon_client")

ENV_HOOKS = "TRAINMON_HOOKS"
"""Hooks to install, comma-separated, ``all`` (the default) or names; ``-name`` removes one."""
ENV_METRICS = "TRAINMON_METRICS"
"""Metrics the hooks send, in the same form as :data:`ENV_HOOKS`."""
ENV_AUTORUN = "TRAINMON_AUTORUN"
"""``1`` in the processes ``trainmon-run`` starts (and their children)."""
HOOKS = ("optimizer", "backward", "clip_grad_norm", "dataloader", "checkpoint", "frameworks")
"""The hooks, each of which can be turned off (``--no-hook``, :data:`ENV_HOOKS`)."""
METRICS = ("loss", "lr", "grad_norm", "data_time", "samples")
"""The metrics the hooks can send (``--metrics``, :data:`ENV_METRICS`)."""
STEP_KEYS = ("step", "global_step", "iteration", "iter", "train_step", "num_steps")
"""Keys of a loaded checkpoint read as its step when the optimizer's state has none."""
EVALUATION = "evaluation"
"""The operation a DataLoader pass without gradients is timed as (``Run.track``)."""

_perf = time.perf_counter
_instance: Instrumenter | None = None


def parse_names(raw: str | None, allowed: Sequence[str], variable: str) -> frozenset[str]:
    """``all`` or a comma-separated list of ``allowed`` names, ``-name`` removing one.

    Unknown names are left out with one warning each. ``None`` or ``""`` means ``all``.

    Example:
        >>> sorted(parse_names("all,-samples", METRICS, "TRAINMON_METRICS"))
        ['data_time', 'grad_norm', 'lr', 'loss']
    """
    chosen: set[str] = set()
    items = [p.strip() for p in (raw or "all").split(",") if p.strip()]
    if not items or items[0].startswith("-"):
        items.insert(0, "all")
    for item in items:
        name = item.lstrip("-+")
        names = set(allowed) if name == "all" else {name}
        if not names <= set(allowed):
            log.warning(
                "trainmon-run: %s: unknown name %r ignored (known: %s)",
                variable,
                name,
                ", ".join(allowed),
            )
            continue
        if item.startswith("-"):
            chosen -= names
        else:
            chosen |= names
    return frozenset(chosen)


def install(env: Mapping[str, str] | None = None) -> Instrumenter | None:
    """Instrument this process (once): the import hook now, the PyTorch hooks at ``import torch``.

    Called by ``trainmon-run``'s ``sitecustomize``; does nothing unless ``TRAINMON_AUTORUN`` is
    ``1``. Returns the process's :class:`Instrumenter`.
    """
    global _instance
    env = os.environ if env is None else env
    if env.get(ENV_AUTORUN) != "1":
        return None
    if _instance is None:
        _instance = Instrumenter(
            parse_names(env.get(ENV_HOOKS), HOOKS, ENV_HOOKS),
            parse_names(env.get(ENV_METRICS), METRICS, ENV_METRICS),
        )
        _instance.watch_imports()
    return _instance


def current() -> Instrumenter | None:
    """The process's :class:`Instrumenter`, if ``trainmon-run`` installed one."""
    return _instance


# ----------------------------------------------------------------------------- import hook


class _ThenCall:
    """A module's own loader, and a call once its module has executed."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module keeps its own loader (inspect, linecache and importlib.resources read it).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        try:
            self._then(module)
        except Exception:
            log.debug("trainmon-run: patching %s failed", module.__name__, exc_info=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _AfterImport:
    """Calls ``then(module)`` right after one of the watched modules is first imported."""

    def __init__(self, watched: dict[str, Callable[[ModuleType], None]]) -> None:
        self.watched = watched
        self._busy: set[str] = set()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        then = self.watched.get(fullname)
        if then is None or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ThenCall(spec.loader, then)  # type: ignore[assignment]
        return spec


# ----------------------------------------------------------------------------- helpers


def _wrap(
    owner: Any, name: str, make: Callable[[Any], Callable[..., Any]], undo: list[Any] | None = None
) -> None:
    """Replace ``owner.name`` with ``make(original)`` (once), keeping the original's metadata.

    ``undo`` gets ``(owner, name, original)``.
    """
    original = getattr(owner, name)
    if getattr(original, "__trainmon__", False):
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper.__trainmon__ = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
    if undo is not None:
        undo.append((owner, name, original))


def _alias(wrapper: Callable[..., Any]) -> Callable[[Any], Callable[..., Any]]:
    """For :func:`_wrap`: a second name of a function already wrapped gets the same wrapper."""
    return lambda _original: wrapper


def _looks_like_state(obj: Any, torch: Any) -> bool:
    """Whether a saved or loaded object is a checkpoint.

    A module, or a mapping holding tensors (a state dict) or mappings of them (``{"model": ...,
    "optimizer": ...}``).
    """
    if isinstance(obj, torch.nn.Module):
        return True
    if not isinstance(obj, Mapping):
        return False
    for i, value in enumerate(obj.values()):
        if i >= 64:
            break
        if isinstance(value, torch.Tensor):
            return True
        if isinstance(value, Mapping) and any(
            isinstance(v, (torch.Tensor, Mapping)) for v in islice(value.values(), 64)
        ):
            return True
    return False


def _step_in(obj: Any, torch: Any) -> int | None:
    """The step a checkpoint names under one of :data:`STEP_KEYS` (top level or one down)."""
    if not isinstance(obj, Mapping):
        return None
    for mapping in (obj, *[v for v in islice(obj.values(), 32) if isinstance(v, Mapping)]):
        for key in STEP_KEYS:
            value = mapping.get(key)
            if (
                isinstance(value, torch.Tensor)
                and value.device.type == "cpu"
                and value.numel() == 1
            ):
                value = value.item()
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
    return None


def _optimizer_steps(optimizer: Any, torch: Any) -> int | None:
    """Steps the optimizer's state says it took (Adam's, AdamW's... ``state[p]["step"]``).

    None when it keeps no count (SGD) or keeps it on a device, where reading it would wait.
    """
    try:
        for state in optimizer.state.values():
            value = state.get("step") if isinstance(state, Mapping) else None
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                if value.device.type != "cpu" or value.numel() != 1:
                    return None
                value = value.item()
            return int(value)
    except Exception:
        return None
    return None


def _first_dim(item: Any, torch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (host shape), else 0."""
    for _ in range(4):
        if isinstance(item, torch.Tensor):
            return int(item.shape[0]) if item.dim() else 0
        if isinstance(item, Mapping):
            item = next(iter(item.values()), None)
        elif isinstance(item, (list, tuple)):
            item = item[0] if item else None
        else:
            return 0
    return 0


class _Timed:
    """A DataLoader's iterator, each ``next()`` timed; everything else passes through."""

    __slots__ = ("__weakref__", "_ins", "_it")

    def __init__(self, it: Any, ins: Instrumenter) -> None:
        self._it = it
        self._ins = ins

    def __iter__(self) -> _Timed:
        return self

    def __next__(self) -> Any:
        t0 = _perf()
        try:
            item = self._it.__next__()
        except StopIteration:
            self._ins.exhausted(self)
            raise
        self._ins.fetched(self, t0, item)
        return item

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


# ----------------------------------------------------------------------------- the hooks


class Instrumenter:
    """The hooks of one process and the step they build between two optimizer steps.

    A step is one ``step()`` of the *primary* optimizer: the first that steps (the next one to
    step once it is garbage-collected). After it, one :meth:`Run.log` sends:

    - ``loss``: the scalar tensors ``backward()`` was called on since the previous optimizer
      step of any optimizer, summed (gradient accumulation: the step's loss when each
      micro-batch's loss is divided by their number, as usual); a loss scaled by
      ``GradScaler.scale`` is reported unscaled. Another optimizer's step drops what was
      summed, so a GAN's generator loss is not added to the discriminator's;
    - ``lr``: ``param_groups[0]["lr"]`` before the step (the rate it used);
    - ``grad_norm``: the last value ``clip_grad_norm_`` returned since the previous step;
    - ``data_time``: seconds spent in ``next()`` of DataLoaders iterated with gradients
      enabled, and ``samples``: the first dimension of their batches' first tensors.

    The step number continues the optimizer's own count when its state keeps one (Adam, AdamW
    and most others: ``state[p]["step"]``, read once when the run starts and after each
    restore); else it counts from 0, or from the loaded checkpoint's ``step`` key.

    Attributes:
        hooks, metrics: what :func:`install` parsed.
        run: the process's run, from the first optimizer step or evaluation pass (None before).
        active: False once a framework's adapter took over (:meth:`take_over`).
        seconds: wall seconds spent inside the hooks (``time.perf_counter``), ``log()`` included.
        steps, backwards: optimizer steps reported and ``backward()`` calls seen.
    """

    def __init__(self, hooks: frozenset[str], metrics: frozenset[str]) -> None:
        self.hooks = hooks
        self.metrics = metrics
        self.run: Any = None
        self.active = True
        self.framework: str | None = None
        self.seconds = 0.0
        self.steps = 0
        self.backwards = 0
        self._torch: Any = None
        self._compiling: Callable[[], bool] = lambda: False
        self._primary: weakref.ref[Any] | None = None
        self._step = 0
        self._loss: Any = None
        self._norm: Any = None
        self._lr: Any = None
        self._data = 0.0
        self._samples = 0
        self._scaled: tuple[weakref.ref[Any], Any] | None = None  # GradScaler.scale's last
        self._span: list[Any] | None = None  # [kind, t0, t1, step key]: saves or loads
        self._pending_saves: list[tuple[float, int | None]] = []  # before the run started
        self._restore: tuple[float, int | None] | None = None  # a load, resolved at a step
        self._evaluation: Any = None  # the Operation of an evaluation pass
        self._eval_iters: weakref.WeakSet[_Timed] = weakref.WeakSet()
        self._io: Any = None  # threading.local(): depth of checkpoint calls, from hook_torch
        self._failed_start = False
        self.holding = 0  # inside a framework's step: post_step holds its log (held)
        self.held: tuple[int, dict[str, Any]] | None = None
        self.inside_engine = 0  # inside a framework's backward: the loss comes from it
        self._undo: list[tuple[Any, str, Any]] = []  # what uninstall() puts back
        self._handles: list[Any] = []  # the optimizer hooks' handles
        self._finder: _AfterImport | None = None

    # ------------------------------------------------------------------------- installation

    def watch_imports(self) -> None:
        """Patch each watched module now if it is imported, else right after its import."""
        watched: dict[str, Callable[[ModuleType], None]] = {"torch": self.hook_torch}
        if "checkpoint" in self.hooks:
            watched["torch.distributed.checkpoint"] = self.hook_dcp
            watched["accelerate.accelerator"] = self.hook_accelerate
        if "frameworks" in self.hooks:
            from trainmon_client import _adopt

            watched.update(_adopt.watched(self))
        pending = {}
        for name, then in watched.items():
            module = sys.modules.get(name)
            if module is not None:
                then(module)
            else:
                pending[name] = then
        self._finder = _AfterImport(pending)
        sys.meta_path.insert(0, self._finder)

    def uninstall(self) -> None:
        """Remove every hook and put back every function and method patched (for tests)."""
        global _instance
        self.take_over("uninstalled")
        for handle in self._handles:
            handle.remove()
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._handles.clear()
        self._undo.clear()
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        atexit.unregister(self._at_exit)
        if _instance is self:
            _instance = None

    def hook_torch(self, torch: ModuleType) -> None:
        """Install the PyTorch hooks (right after ``import torch``)."""
        import threading

        self._torch = torch
        self._io = threading.local()
        compiler = getattr(torch, "compiler", None)
        self._compiling = getattr(compiler, "is_compiling", None) or (lambda: False)
        hooks = self.hooks
        if "optimizer" in hooks:
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )

            self._handles.append(register_optimizer_step_pre_hook(self.pre_step))
            self._handles.append(register_optimizer_step_post_hook(self.post_step))
        if "backward" in hooks:
            _wrap(torch.autograd, "backward", self._backward_wrapper, self._undo)
            from torch.amp import grad_scaler

            _wrap(grad_scaler.GradScaler, "scale", self._scale_wrapper, self._undo)
        if "clip_grad_norm" in hooks:
            from torch.nn.utils import clip_grad

            _wrap(clip_grad, "clip_grad_norm_", self._clip_wrapper, self._undo)
            _wrap(torch.nn.utils, "clip_grad_norm_", _alias(clip_grad.clip_grad_norm_), self._undo)
        if "dataloader" in hooks:
            from torch.utils.data import DataLoader

            _wrap(DataLoader, "__iter__", self._iter_wrapper, self._undo)
        if "checkpoint" in hooks:
            from torch import serialization

            for name in ("save", "load"):
                _wrap(
                    serialization, name, functools.partial(self._io_wrapper, kind=name), self._undo
                )
                _wrap(torch, name, _alias(getattr(serialization, name)), self._undo)

    def hook_dcp(self, dcp: ModuleType) -> None:
        """Distributed checkpoints: ``save``, ``async_save`` (its blocking part), ``load``."""
        for name, kind in (("save", "save"), ("async_save", "save"), ("load", "load")):
            if hasattr(dcp, name):
                _wrap(
                    dcp, name, functools.partial(self._io_wrapper, kind=kind, dcp=True), self._undo
                )

    def hook_accelerate(self, module: ModuleType) -> None:
        """``Accelerator.save_state`` and ``load_state``: each one checkpoint, all its files."""
        cls = getattr(module, "Accelerator", None)
        if cls is not None:
            for name, kind in (("save_state", "save"), ("load_state", "load")):
                _wrap(
                    cls, name, functools.partial(self._io_wrapper, kind=kind, dcp=True), self._undo
                )

    def take_over(self, framework: str, keep_run: bool = True) -> Any:
        """A framework's adapter reports from now on: the hooks stop, for good, in this process.

        Returns the run the hooks had started, for the adapter to use (None if none; with
        ``keep_run=False`` it is finished, as the adapter starts its own). What the hooks had
        seen but not sent (a checkpoint of a model's weights loaded before the framework's
        trainer was built) is dropped: the adapter reports the framework's own.
        """
        self.active = False
        self.framework = framework
        self._span = self._restore = None
        self._pending_saves.clear()
        self._loss = self._norm = None
        self._end_evaluation()
        run, self.run = self.run, None
        if run is not None and not keep_run:
            run.finish()
            return None
        return run

    # ------------------------------------------------------------------------- the run

    def _start(self, optimizer: Any) -> bool:
        """Start the run at the first optimizer step or evaluation pass; False if it failed."""
        if self.run is not None:
            return True
        if self._failed_start:
            return False
        try:
            from trainmon_client._env import _process_start
            from trainmon_client._run import init

            kwargs: dict[str, Any] = {}
            dist = getattr(self._torch, "distributed", None)
            if dist is not None and dist.is_available() and dist.is_initialized():
                # mp.spawn and similar set no RANK: the process group knows (no communication)
                kwargs["rank"] = dist.get_rank()
                kwargs["world_size"] = dist.get_world_size()
                if "LOCAL_RANK" not in os.environ:
                    kwargs["local_rank"] = kwargs["rank"]
            started = _process_start(os.getpid())
            if started is not None and started <= time.time():
                kwargs["started_at"] = started
            self.run = init(**kwargs)
        except Exception:
            self._failed_start = True
            log.warning(
                "trainmon-run: could not start the run; the program runs without", exc_info=True
            )
            return False
        atexit.register(self._at_exit)  # after the run's own: runs before it
        if optimizer is not None:
            n = _optimizer_steps(optimizer, self._torch)
            if n and self._restore is None:  # resumed, the load not seen (safetensors...)
                self._restore = (float("nan"), None)
        for seconds, _ in self._pending_saves:
            self.run.checkpoint(0, seconds=seconds)
        self._pending_saves.clear()
        return True

    def _resolve_restore(self, optimizer: Any) -> None:
        seconds, key = self._restore  # type: ignore[misc]
        self._restore = None
        n = None if optimizer is None else _optimizer_steps(optimizer, self._torch)
        step = n if n is not None else key if key is not None else self._step
        self._step = step
        self.run.checkpoint(step, seconds=None if seconds != seconds else seconds, restore=True)

    def _at_exit(self) -> None:
        try:
            if self._span is not None:
                self._close_span()
            if self._restore is not None and self.run is not None:
                self._resolve_restore(None)
            self._end_evaluation()
            if self.backwards and not self.steps and self.active:
                log.warning(
                    "trainmon-run: %d backward() calls and no optimizer step seen in this "
                    "process, so no steps were reported: an optimizer that is not a "
                    "torch.optim.Optimizer, or one stepped inside torch.compile, is not seen",
                    self.backwards,
                )
        except Exception:
            log.debug("trainmon-run: exit hook failed", exc_info=True)

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
        """Patch ``owner.name`` with ``make(original)``; :meth:`uninstall` puts it back."""
        _wrap(owner, name, make, self._undo)

    def count_error(self) -> None:
        """Count a failure of a hook (an adapter's too) and go on."""
        self._error()

    def _error(self) -> None:
        if self.run is not None:
            self.run.count_internal_error()
        log.debug("trainmon-run: a hook failed", exc_info=True)

    # ------------------------------------------------------------------------- optimizer

    def pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer pre-step hook: the run starts; restores, saves and lr are read."""
        if not self.active or self._compiling():
            return
        t0 = _perf()
        try:
            primary = self._primary() if self._primary is not None else None
            if primary is None:
                self._primary = weakref.ref(optimizer)
                primary = optimizer
            if optimizer is primary:
                if self.run is None and not self._start(optimizer):
                    return
                if self._span is not None:
                    self._close_span()
                if self._restore is not None:
                    self._resolve_restore(optimizer)
                if self._evaluation is not None:
                    self._end_evaluation()
                if "lr" in self.metrics:
                    groups = optimizer.param_groups
                    self._lr = groups[0].get("lr") if groups else None
        except Exception:
            self._error()
        finally:
            self.seconds += _perf() - t0

    def post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global optimizer post-step hook: the primary optimizer's step is logged."""
        if not self.active or self._compiling():
            return
        t0 = _perf()
        try:
            primary = self._primary() if self._primary is not None else None
            run = self.run
            if optimizer is not primary or run is None:
                self._loss = self._norm = None  # another optimizer's: not this step's
                return
            self._step += 1
            self.steps += 1
            metrics: dict[str, Any] = {}
            if self._loss is not None:
                metrics["loss"] = self._loss
                self._loss = None
            if self._lr is not None:
                metrics["lr"] = self._lr
                self._lr = None
            if self._norm is not None:
                metrics["grad_norm"] = self._norm
                self._norm = None
            if self._data and "data_time" in self.metrics:
                metrics["data_time"] = self._data
            self._data = 0.0
            if self._samples and "samples" in self.metrics:
                metrics["samples"] = self._samples
            self._samples = 0
            for key, value in metrics.items():  # a host tensor: read it now, it never waits
                if value.__class__ is not float and getattr(value, "is_cpu", False):
                    metrics[key] = value.item()
            if self.holding:
                self.held = (self._step, metrics)
            else:
                run.log(self._step, **metrics)
        except Exception:
            self._error()
        finally:
            self.seconds += _perf() - t0

    def add_loss(self, value: Any) -> None:
        """Add a micro-batch's loss (a tensor, kept on the device) to the step's (adapters)."""
        if self.active and "loss" in self.metrics:
            loss = self._loss
            value = value.detach().float()
            self._loss = value if loss is None else loss + value

    # ------------------------------------------------------------------------- backward, clipping

    def _backward_wrapper(self, backward: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = backward(*args, **kwargs)
            if self.active and not self._compiling():
                self.backward_done(args, kwargs)
            return out

        return wrapper

    def backward_done(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """A ``backward()`` returned: add its root to the step's loss (on the device)."""
        t0 = _perf()
        try:
            self.backwards += 1
            if self._span is not None:
                self._close_span()
            if self._evaluation is not None:
                self._end_evaluation()
            if "loss" not in self.metrics or self.inside_engine:
                return
            tensors = args[0] if args else kwargs.get("tensors")
            gradient = args[1] if len(args) > 1 else kwargs.get("grad_tensors")
            if isinstance(tensors, (list, tuple)):
                tensors = tensors[0] if len(tensors) == 1 else None
                if isinstance(gradient, (list, tuple)):
                    gradient = gradient[0] if len(gradient) == 1 else gradient
            torch = self._torch
            if gradient is not None or not isinstance(tensors, torch.Tensor):
                return
            if tensors.numel() != 1:
                return
            scaled = self._scaled
            scaled_here = scaled is not None and scaled[0]() is tensors
            value = scaled[1] if scaled_here else tensors.detach()  # type: ignore[index]
            self._scaled = None
            loss = self._loss
            self._loss = value if loss is None else loss.float() + value.float()
        except Exception:
            self._error()
        finally:
            self.seconds += _perf() - t0

    def _scale_wrapper(self, scale: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(scaler: Any, outputs: Any, *args: Any, **kwargs: Any) -> Any:
            out = scale(scaler, outputs, *args, **kwargs)
            if self.active and not self._compiling():
                try:
                    if isinstance(outputs, self._torch.Tensor) and out is not outputs:
                        self._scaled = (weakref.ref(out), outputs.detach())
                except Exception:
                    self._error()
            return out

        return wrapper

    def _clip_wrapper(self, clip: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            norm = clip(*args, **kwargs)
            if self.active and "grad_norm" in self.metrics and not self._compiling():
                try:
                    if isinstance(norm, self._torch.Tensor) and norm.numel() == 1:
                        self._norm = norm.detach()
                    elif isinstance(norm, (int, float)):
                        self._norm = norm
                except Exception:
                    self._error()
            return norm

        return wrapper

    # ------------------------------------------------------------------------- data loading

    def _iter_wrapper(self, iter_: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def __iter__(loader: Any) -> Any:
            it = iter_(loader)
            if not self.active or isinstance(it, _Timed):
                return it
            return _Timed(it, self)

        return __iter__

    def fetched(self, proxy: _Timed, t0: float, item: Any) -> None:
        """A batch arrived after ``perf_counter() - t0`` s: training data time, or evaluation."""
        t1 = _perf()
        if not self.active:
            return
        try:
            if self._span is not None:
                self._close_span()
            torch = self._torch
            if torch.is_grad_enabled():
                if self._evaluation is not None:
                    self._end_evaluation()
                self._data += t1 - t0
                if "samples" in self.metrics:
                    self._samples += _first_dim(item, torch)
            elif self._evaluation is None and not self._compiling():
                if torch.utils.data.get_worker_info() is None and self._start(None):
                    self._evaluation = self.run.track(EVALUATION)
                    self._evaluation.start()
                    self._eval_iters.add(proxy)
            else:
                self._eval_iters.add(proxy)
        except Exception:
            self._error()
        finally:
            self.seconds += _perf() - t1

    def exhausted(self, proxy: _Timed) -> None:
        """A DataLoader pass ended: an evaluation pass's operation stops."""
        if proxy in self._eval_iters:
            self._end_evaluation()

    def _end_evaluation(self) -> None:
        evaluation, self._evaluation = self._evaluation, None
        self._eval_iters = weakref.WeakSet()
        if evaluation is not None:
            evaluation.stop()

    # ------------------------------------------------------------------------- checkpoints

    def _io_wrapper(
        self, function: Callable[..., Any], kind: str, dcp: bool = False
    ) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            io = self._io
            depth = getattr(io, "depth", 0)
            if depth or not self.active or self._compiling():
                return function(*args, **kwargs)
            io.depth = 1
            t0 = _perf()
            try:
                out = function(*args, **kwargs)
            finally:
                io.depth = 0
            self.io_done(kind, t0, _perf(), args, kwargs, out, dcp)
            return out

        return wrapper

    def io_done(
        self,
        kind: str,
        t0: float,
        t1: float,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        out: Any,
        whole: bool,
    ) -> None:
        """A save or load returned: extend the checkpoint in progress, or open one.

        Saves (or loads) with no training in between (no optimizer step, ``backward()`` or
        batch) are one checkpoint: a model, its optimizer and its scheduler in three files are
        one save. It is reported at the next of those, with the seconds from the first call's
        start to the last one's end. ``whole``: a call that is a checkpoint by itself
        (``torch.distributed.checkpoint``, ``Accelerator.save_state``); a ``torch.save`` or
        ``torch.load`` counts only for a module or a mapping of tensors.
        """
        s = _perf()
        try:
            torch = self._torch
            if torch is None or torch.utils.data.get_worker_info() is not None:
                return
            if whole:
                obj = kwargs.get("state_dict", args[0] if args else None)
                if kind == "save" and not isinstance(obj, Mapping):
                    obj = None
            else:
                obj = (args[0] if args else kwargs.get("obj")) if kind == "save" else out
                if not _looks_like_state(obj, torch):
                    return
            key = _step_in(obj, torch) if kind == "load" else None
            span = self._span
            if span is not None and span[0] != kind:
                self._close_span()
                span = None
            if span is None:
                self._span = [kind, t0, t1, key]
            else:
                span[2] = t1
                if key is not None:
                    span[3] = key
        except Exception:
            self._error()
        finally:
            self.seconds += _perf() - s

    def _close_span(self) -> None:
        span, self._span = self._span, None
        if span is None:
            return
        kind, t0, t1, key = span
        if kind == "load":
            self._restore = (t1 - t0, key)
        elif self.run is None:
            self._pending_saves.append((t1 - t0, key))
        else:
            self.run.checkpoint(self._step, seconds=t1 - t0)


def lightning_callbacks() -> list[Any]:
    """Lightning's ``lightning.pytorch.callbacks_factory`` entry point.

    Under ``trainmon-run``, the trainmon callback for every ``lightning.Trainer``; else none.

    A Trainer already given a ``TrainmonCallback`` keeps that one: the added one stays idle.
    """
    ins = _instance
    if ins is None or "frameworks" not in ins.hooks:
        return []
    try:
        from trainmon_client import _adopt

        return _adopt.lightning_callbacks(ins)
    except Exception:
        log.warning("trainmon-run: could not add the Lightning callback", exc_info=True)
        return []
