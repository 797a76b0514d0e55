"""CUDA graphs of a model's step, as an explicit opt-in: :func:`graphed`.

``import torchpatches`` never captures anything. ``graphed(model)`` returns a callable that runs ``model``'s call
through one CUDA graph per input signature, so enqueueing a step costs a few copies and one graph launch instead
of the host work of every module call and kernel launch (FLUX.1-dev: ~466 GEMMs and ~324 Triton launches)::

    from torchpatches.cuda_graphs import graphed

    step = graphed(pipe.transformer)
    noise = step(hidden_states=x, timestep=t, ..., return_dict=False)[0]   # same arguments as the model

Semantics (docs/cuda_graphs.md has the long form):

- **One graph per signature**: argument structure, each tensor's shape, strides, dtype, device, every other
  argument by value, plus the process state the model's Python read (applied patches, forced op tier, autocast,
  global hooks, grad/inference mode). The first call of a signature warms up (``warmup`` eager calls on a side
  stream) and captures; later calls copy the tensors into the graph's **static input buffers** and replay.
- **Outputs**: with ``clone=True`` (the default) each call returns fresh tensors. With ``clone=False`` it returns
  the graph's static output tensors, overwritten by the next call of this wrapper (any signature: the graphs share
  one memory pool) -- a pipeline that keeps the conditional prediction while it computes the unconditional one
  would silently read the wrong values, which is why cloning (one copy of the output) is the default.
- **Invalidation**: every graph is dropped (and recaptured on the next call) when the model changes: a submodule,
  parameter or buffer replaced, a parameter's storage or dtype changed (``.to()``), hooks added or removed, an
  instance ``forward`` (accelerate/diffusers hooks), training mode, an attention processor replaced, peft adapters
  loaded, unloaded, switched, scaled, disabled, merged. Patches applied or reverted select another graph (both
  kept). :meth:`Graphed.reset` drops everything by hand: after changing anything else the model reads in Python
  (other module attributes, SDPA backend switches, matmul precision).
- **Eager instead of a graph**: CPU or other non-CUDA tensors, no tensor, tensors on two devices, tensor
  subclasses, under ``torch.compile`` (the wrapper's call is traced as the model's), ``torch.jit.trace``,
  forward AD and functorch transforms, and when autograd would record (grad mode with an input or parameter that
  requires grad: warned once) -- a graph cannot record autograd history. A signature whose capture fails (the
  model synchronises with the host: ``.item()``, data-dependent shapes, offloading) is warned once and runs
  eagerly from then on.
- **Refused**: a non-tensor argument that cannot be keyed by value (``ValueError`` naming it), also in a call
  that would run eagerly (CPU tensors, ...): every argument is read first, so their order does not matter.
- **Memory**: the graphs share one private pool per device (about the largest graph's activations), plus each
  graph's static inputs and outputs. At most ``max_graphs`` signatures are kept (least recently used dropped).
- Not thread-safe: one wrapper per thread.
"""
from __future__ import annotations

import collections
import logging
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from .._core.compat import is_compiling
from ._capture import CaptureFailed, CudaBackend
from ._keys import ModelWatch, Refused, call_key, global_token, static_like
from ..ops._runtime.tiers import eager_transforms

__all__ = ["graphed", "Graphed", "GraphInfo"]

logger = logging.getLogger("torchpatches")

#: A signature whose capture failed: it runs eagerly (kept in the LRU like a graph).
_EAGER = object()


class GraphInfo(tuple):
    """``(captures, replays, eager_calls, graphs)`` of a :class:`Graphed` wrapper, for tests and benchmarks."""

    __slots__ = ()
    _fields = ("captures", "replays", "eager_calls", "graphs")

    def __new__(cls, captures: int, replays: int, eager_calls: int, graphs: int) -> "GraphInfo":
        return super().__new__(cls, (captures, replays, eager_calls, graphs))

    captures = property(lambda self: self[0])
    replays = property(lambda self: self[1])
    eager_calls = property(lambda self: self[2])
    graphs = property(lambda self: self[3])

    def __repr__(self) -> str:
        return "GraphInfo(" + ", ".join(f"{k}={v}" for k, v in zip(self._fields, self)) + ")"


class _Graph:
    """One captured call: its static input buffers, its replay and its static output (a pytree)."""

    __slots__ = ("statics", "replay", "leaves", "spec", "device")

    def __init__(self, statics: List[torch.Tensor], replay: Callable[[], None], output: Any,
                 device: torch.device) -> None:
        self.statics, self.replay, self.device = statics, replay, device
        self.leaves, self.spec = pytree.tree_flatten(output)

    def __call__(self, tensors: List[torch.Tensor], clone: bool) -> Any:
        for static, tensor in zip(self.statics, tensors):
            if tensor is not static:
                static.copy_(tensor)
        self.replay()
        leaves = [x.clone() if clone and isinstance(x, torch.Tensor) else x for x in self.leaves]
        return pytree.tree_unflatten(leaves, self.spec)  # a fresh container: mutating it changes no later call


class Graphed:
    """A callable running ``model`` through CUDA graphs, one per input signature (see the module docstring).

    Attribute reads the wrapper does not have go to the model (``.config``, ``.dtype``), so it can stand in
    for the model where only calls and attribute reads happen. Pickling keeps the model and the settings and
    drops the graphs. Build it with :func:`graphed`."""

    def __init__(self, model: Callable[..., Any], *, clone: bool = True, max_graphs: int = 8, warmup: int = 2,
                 watch_model: bool = True, backend: Any = None) -> None:
        if not callable(model):
            raise ValueError(f"graphed: expected a module or a callable, got {type(model).__name__}")
        if isinstance(model, Graphed):
            raise ValueError("graphed: the model is already a graphed wrapper; wrap the model itself once")
        if not isinstance(max_graphs, int) or isinstance(max_graphs, bool) or max_graphs < 1:
            raise ValueError(f"graphed: max_graphs must be an int >= 1, got {max_graphs!r}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ValueError(f"graphed: warmup must be an int >= 1 (capture needs a warmed-up call), got {warmup!r}")
        for name, value in (("clone", clone), ("watch_model", watch_model)):
            if not isinstance(value, bool):
                raise ValueError(f"graphed: {name} must be a bool, got {value!r}")
        self._model = model
        self._clone, self._max_graphs, self._warmup, self._watch_model = clone, max_graphs, warmup, watch_model
        self._backend = backend if backend is not None else CudaBackend()
        self._init_state()

    def _init_state(self) -> None:
        self._graphs: "collections.OrderedDict[Any, Any]" = collections.OrderedDict()
        self._pools: Dict[torch.device, Any] = {}
        self._watch: Optional[ModelWatch] = None
        self._warned_grad = False
        self._counts = [0, 0, 0]  # captures, replays, eager calls

    # ---- public ----------------------------------------------------------------------------------------

    @property
    def model(self) -> Callable[..., Any]:
        """The wrapped model (called as it is for every call a graph does not serve)."""
        return self._model

    def reset(self) -> None:
        """Drop every graph, static buffer and the memory pool; the next call of each signature captures
        again. Needed after changing anything the model reads in Python that the wrapper does not watch."""
        if self._graphs:
            logger.debug("cuda_graphs: dropping %d graph(s) of %s", len(self._graphs), type(self._model).__name__)
        self._graphs.clear()
        self._pools.clear()
        self._watch = None

    def info(self) -> GraphInfo:
        """Captures, replays and eager calls so far, and the graphs held now."""
        held = sum(1 for entry in self._graphs.values() if entry is not _EAGER)
        return GraphInfo(self._counts[0], self._counts[1], self._counts[2], held)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if is_compiling() or eager_transforms():
            return self._model(*args, **kwargs)  # traced as the model's own call; a graph cannot be traced
        key, tensors, _, device = call_key(args, kwargs, self._backend.device_type)
        if isinstance(key, Refused):
            return self._eager(args, kwargs)
        self._check_model()
        if self._records_grad(tensors):
            return self._eager(args, kwargs)
        key = (key, global_token(self._backend.device_type))
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, args, kwargs, tensors, device)
        else:
            self._graphs.move_to_end(key)
        if entry is _EAGER:
            return self._eager(args, kwargs)
        self._counts[1] += 1
        return entry(tensors, self._clone)

    # ---- the steps of a call ----------------------------------------------------------------------------

    def _eager(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        self._counts[2] += 1
        return self._model(*args, **kwargs)

    def _records_grad(self, tensors: List[torch.Tensor]) -> bool:
        """Grad mode with an input or parameter requiring grad: the call runs eagerly (warned once)."""
        if not torch.is_grad_enabled():
            return False
        if not any(t.requires_grad for t in tensors):
            if not isinstance(self._model, torch.nn.Module):
                return False
            if not any(p.requires_grad for p in self._model.parameters()):
                return False
        if not self._warned_grad:
            self._warned_grad = True
            warnings.warn("torchpatches.cuda_graphs: autograd would record this call (grad mode with an input or "
                          "parameter that requires grad); a CUDA graph cannot record it, so it runs eagerly. Call "
                          "under torch.no_grad() or torch.inference_mode() to replay graphs.", RuntimeWarning,
                          stacklevel=3)
        return True

    def _check_model(self) -> None:
        """Every graph dropped when the model changed since they were captured (:class:`ModelWatch`)."""
        if not self._watch_model or not isinstance(self._model, torch.nn.Module):
            return
        if self._watch is not None and self._watch.changed():
            logger.debug("cuda_graphs: %s changed; recapturing", type(self._model).__name__)
            self.reset()
        if self._watch is None:
            self._watch = ModelWatch(self._model)

    def _capture(self, key: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], tensors: List[torch.Tensor],
                 device: torch.device) -> Any:
        statics = static_like(tensors)
        for static, tensor in zip(statics, tensors):
            static.copy_(tensor)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        it = iter(statics)
        static_args, static_kwargs = pytree.tree_unflatten(
            [next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        pool = self._pools.get(device)
        if pool is None or not self._holds_graph_on(device):
            # A private pool is the allocator's only while a graph captured into it lives: once the last one is
            # dropped (a failed capture, an eviction) capturing into it again fails an INTERNAL ASSERT of the
            # CUDA caching allocator (``use_count > 0``), so each such signature would run eagerly.
            pool = self._pools[device] = self._backend.pool(device)
        try:
            replay, output = self._backend.capture(lambda: self._model(*static_args, **static_kwargs), device,
                                                   pool, self._warmup)
            entry: Any = _Graph(statics, replay, output, device)
            self._counts[0] += 1
        except CaptureFailed as error:
            warnings.warn(f"torchpatches.cuda_graphs: {type(self._model).__name__} could not be captured for this "
                          f"input signature ({error}); calls of this signature run eagerly", RuntimeWarning,
                          stacklevel=3)
            entry = _EAGER
        self._graphs[key] = entry
        while len(self._graphs) > self._max_graphs:
            self._graphs.popitem(last=False)  # least recently used
        return entry

    def _holds_graph_on(self, device: torch.device) -> bool:
        return any(isinstance(entry, _Graph) and entry.device == device for entry in self._graphs.values())

    # ---- a stand-in for the model -------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("_model")
        if model is None:  # while unpickling, before __setstate__
            raise AttributeError(name)
        return getattr(model, name)

    def __getstate__(self) -> Dict[str, Any]:
        return {"model": self._model, "clone": self._clone, "max_graphs": self._max_graphs, "warmup": self._warmup,
                "watch_model": self._watch_model, "backend": self._backend}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state.pop("model"), **state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return (f"graphed({type(self._model).__name__}, clone={self._clone}, max_graphs={self._max_graphs}, "
                f"warmup={self._warmup}) with {self.info().graphs} graph(s)")


def graphed(model: Callable[..., Any], *, clone: bool = True, max_graphs: int = 8, warmup: int = 2,
            watch_model: bool = True) -> Graphed:
    """``model`` (an ``nn.Module`` or any callable) run through CUDA graphs, one per input signature.

    - ``clone``: return fresh output tensors (default) rather than the graph's static output, which the next call
      of the wrapper overwrites.
    - ``max_graphs``: signatures kept, least recently used dropped first (a failed capture counts as one).
    - ``warmup``: eager calls on a side stream before a capture (>= 1).
    - ``watch_model``: check on every call that the model has not changed (about 1 ms for FLUX.1-dev's 1,279
      modules, 10 ms or more with peft adapters loaded, on a 2-core CPU); ``False`` skips it, and then
      :meth:`Graphed.reset` after any change is the caller's job. For a callable that is not a module only the
      process state is watched.
    - ``clone`` and ``watch_model`` take ``True`` or ``False``; any other value raises ``ValueError``.

    Calls on CPU tensors run ``model`` as it is, so the same code runs without a GPU. Raises ``ValueError``
    for an argument that cannot be keyed (see the module docstring), on a CPU as on a GPU and in any argument
    order.
    """
    return Graphed(model, clone=clone, max_graphs=max_graphs, warmup=warmup, watch_model=watch_model)
