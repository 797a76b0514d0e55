"""What a CUDA graph of :mod:`torchpatches.cuda_graphs` depends on, read cheaply on every call.

A graph replays the kernels one call launched, with the addresses and the Python decisions of that call. So a
graph is found again by:

- :func:`call_key`: the call's *signature* -- the argument structure (a pytree spec), each tensor's type, shape,
  strides, dtype, device and ``requires_grad``, every other argument by value (``return_dict``, the contents of
  ``joint_attention_kwargs``, ints, floats bit for bit);
- :func:`global_token`: the process state the model's Python read while it was captured -- which torchpatches
  patches are applied, a forced op tier, autocast, module-global forward hooks, grad and inference mode;

and every graph of a model is dropped when :class:`ModelWatch` sees the model change: a submodule, parameter or
buffer replaced, a parameter's storage or dtype changed (``.to()``, ``.data =``), hooks added or removed, a
``forward`` set on an instance, training mode, an attention processor replaced, peft's adapter state (active
adapter, scaling, disabled, merged). In-place changes of a parameter's values need nothing: a graph reads the
same memory.
"""
from __future__ import annotations

import enum
import itertools
import operator
import sys
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

__all__ = ["Refused", "call_key", "global_token", "ModelWatch", "static_like", "PLAIN_TENSORS"]

#: Tensor types a graph copies into its static buffers; any other (subclasses, wrappers) runs eagerly.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

#: Non-tensor argument types keyed by value (containers of them are walked by pytree).
_VALUE_TYPES = (type(None), bool, int, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                torch.memory_format, type(Ellipsis), enum.Enum)


class Refused(str):
    """Why a call runs eagerly instead of through a graph (a ``str``; :func:`call_key` returns it)."""


def _value_key(value: Any) -> Any:
    """A non-tensor argument as part of a key: floats bit for bit (``nan`` finds itself, ``-0.0`` is not
    ``0.0``), the type kept (``1``, ``1.0`` and ``True`` are three keys). None for a type not keyed by value."""
    if type(value) is float:
        return (float, value.hex())
    if isinstance(value, _VALUE_TYPES):
        return (type(value), value)
    return None


def _path_of(args: Tuple[Any, ...], kwargs: Dict[str, Any], index: int) -> str:
    """The argument the ``index``-th leaf is, as a user would write it (``kwargs['joint_attention_kwargs']['x']``)."""
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    path = leaves[index][0]
    head, rest = ("args", path[1:]) if path[0].idx == 0 else ("kwargs", path[1:])  # type: ignore[attr-defined]
    return head + pytree.keystr(rest)


def call_key(args: Tuple[Any, ...], kwargs: Dict[str, Any], device_type: str
             ) -> Tuple[Any, List[torch.Tensor], Any, Optional[torch.device]]:
    """(key, tensor leaves, pytree spec, device) of a call, or ``(Refused(reason), [], spec, None)`` for a call
    a graph does not serve: no tensor, a tensor not on one ``device_type`` device, a tensor subclass, a
    non-strided layout. A non-tensor argument that cannot be keyed by value raises ``ValueError`` naming it,
    whatever the tensors (a refused call too): every argument is read before the call is refused, so the order
    of the arguments does not change the outcome."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts: List[Any] = [spec]
    tensors: List[torch.Tensor] = []
    device: Optional[torch.device] = None
    refused: Optional[Refused] = None
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if refused is not None:
                continue
            if type(leaf) not in PLAIN_TENSORS or leaf.layout is not torch.strided:
                refused = Refused(f"an argument is a {type(leaf).__name__} ({leaf.layout})")
                continue
            if device is None:
                device = leaf.device
            if leaf.device != device or device.type != device_type:
                refused = Refused(f"tensor arguments on {leaf.device} (graphs serve one {device_type} device)")
                continue
            tensors.append(leaf)
            parts.append((leaf.shape, leaf.stride(), leaf.dtype, leaf.requires_grad))
            continue
        key = _value_key(leaf)
        if key is None:
            raise ValueError(
                f"graphed: argument {_path_of(args, kwargs, index)} is a {type(leaf).__module__}."
                f"{type(leaf).__qualname__}; a graph is keyed by the value of every non-tensor argument, so those "
                "must be None, bool, int, float, complex, str, bytes, enums, torch.dtype/device/layout/memory_format"
                " or tuples, lists and dicts of these (pass changing values as tensors)")
        parts.append(key)
    if refused is None and device is None:
        refused = Refused("no tensor argument")
    if refused is not None:
        return refused, [], spec, None
    parts.append(device)
    return tuple(parts), tensors, spec, device


def global_token(device_type: str) -> Tuple[Any, ...]:
    """The process state a captured call's Python read: applied patches, the forced op tier, autocast, global
    forward hooks, grad and inference mode. Part of every key, so switching back finds the graph again."""
    from ..ops._runtime.tiers import forced_tier

    # the package's Registry instance (``torchpatches._registry``), read without importing the package from below
    top = sys.modules.get(__name__.partition(".")[0])
    applied_names = getattr(getattr(top, "_registry", None), "applied_names", None)
    applied = applied_names() if applied_names is not None else ()
    m = torch.nn.modules.module
    autocast = torch.is_autocast_enabled(device_type)
    return (applied, forced_tier(), autocast, torch.get_autocast_dtype(device_type) if autocast else None,
            len(m._global_forward_hooks), len(m._global_forward_pre_hooks), torch.is_grad_enabled(),
            torch.is_inference_mode_enabled())


# ---- the model ---------------------------------------------------------------------------------------


def _tensor_value(value: Any) -> Any:
    return (id(value), value.data_ptr()) if isinstance(value, torch.Tensor) else value


def _adapter_state(d: Dict[str, Any]) -> Tuple[Any, ...]:
    """peft's per-layer adapter state, read by its forward at capture time: the scaling per adapter (a float,
    or a tensor after ``prepare_model_for_compiled_hotswap``: then by storage, its values change in place),
    the active adapter(s), disabled, merged."""
    scaling = d["scaling"]
    return (tuple((name, _tensor_value(value)) for name, value in scaling.items()), repr(d.get("_active_adapter")),
            d.get("_disable_adapters"), len(d.get("merged_adapters") or ()))


# The per-module entries a check reads, fetched in one pass over the modules' dicts and flattened as they come:
# the check's cost follows the module count (6,229 in FLUX.1 with one peft adapter). Each tuple is freed before
# the next is made: thousands of live tuples of dicts would stay tracked by the garbage collector and bring on
# full collections of the process's heap (2.5x the check's time, measured with FLUX.1 + one adapter).
_ENTRY_KEYS = ("training", "_forward_hooks", "_forward_pre_hooks", "_modules", "_parameters", "_buffers")
_ENTRIES = operator.itemgetter(*_ENTRY_KEYS)
_VALUES, _DATA_PTR, _DTYPE = operator.methodcaller("values"), operator.methodcaller("data_ptr"), \
    operator.attrgetter("dtype")


class ModelWatch:
    """A snapshot of what a module tree's graphs depend on; :meth:`changed` compares the tree with it.

    The snapshot lists every module's ``__dict__`` and every parameter and buffer once; a check reads, per module,
    its submodules, parameters and buffers (compared by identity: a replaced one changes its parent's entry), its
    hook counts, training mode, an instance ``forward``, the attention ``processor`` object and peft's adapter
    state, and per tensor its storage address and dtype. Each is one list built in C across all modules, and
    the parts are compared in order until one differs. Its cost follows the module count: docs/cuda_graphs.md
    ("What drops the graphs") has the figures, ``benchmarks/model_watch.py`` measures them."""

    __slots__ = ("_dicts", "_tensors", "_adapters", "_processors", "_state")

    def __init__(self, model: torch.nn.Module) -> None:
        modules = list(model.modules())
        self._dicts = [m.__dict__ for m in modules]
        self._tensors = [t for d in self._dicts for t in (*d["_parameters"].values(), *d["_buffers"].values())
                         if t is not None]
        self._adapters = [d for d in self._dicts if isinstance(d.get("scaling"), dict)]
        self._processors = [d for d in self._dicts if "processor" in d]
        self._state = list(self._reads())

    def _reads(self) -> Iterator[Tuple[Any, List[Any]]]:
        """The snapshot's parts, each a pair (values compared with ``==``, objects compared by identity),
        computed only when the part before it was the same."""
        dicts, width = self._dicts, len(_ENTRY_KEYS)
        entries = list(itertools.chain.from_iterable(map(_ENTRIES, dicts)))
        training, hooks, pre_hooks, children, parameters, buffers = (entries[i::width] for i in range(width))
        yield (training, list(map(len, hooks)), list(map(len, pre_hooks)),
               list(map(operator.contains, dicts, itertools.repeat("forward")))), []
        yield [_adapter_state(d) for d in self._adapters], [d["processor"] for d in self._processors]
        for containers in (children, parameters, buffers):
            # the counts per module and the entries in order say which object sits in which module
            yield list(map(len, containers)), list(itertools.chain.from_iterable(map(_VALUES, containers)))
        yield (list(map(_DATA_PTR, self._tensors)), list(map(_DTYPE, self._tensors))), []

    def changed(self) -> bool:
        for (values, objects), (then_values, then_objects) in zip(self._reads(), self._state):
            if values != then_values or len(objects) != len(then_objects) or \
                    not all(map(operator.is_, objects, then_objects)):
                return True
        return False


def static_like(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The static input buffers of a graph: like each tensor (same strides where its memory is dense, else
    dense), plain tensors outside inference mode (so they can be written in any mode), not requiring grad."""
    with torch.inference_mode(False):
        return [torch.empty_like(t, memory_format=torch.preserve_format, requires_grad=False) for t in tensors]
