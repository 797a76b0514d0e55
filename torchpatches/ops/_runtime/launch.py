"""Cached Triton launches: specialise a kernel once per argument class, then call its compiled launcher.

``kernel[grid](*args, **constexprs)`` runs ``JITFunction.run`` on every call: it binds the arguments,
specialises each one (``native_specialize_impl``), turns the result into a string key, builds launch
metadata and calls the (empty) launch hooks; about 90 us per launch under cProfile on an H100 host, 324
launches per fused FLUX.1-dev step. Inductor's generated code calls the compiled kernel's launcher
instead. ``launch(kernel, grid, args, constexprs)`` does the same for torchpatches' kernels:

- the first call of an argument class goes through ``kernel.run`` (exactly what ``kernel[grid]`` does: it
  compiles or finds the kernel, launches it and returns the ``CompiledKernel``); its launcher is kept;
- later calls of that class call the launcher the way ``JITFunction.run`` ends:
  ``launcher(g0, g1, g2, stream, function, packed_metadata, None, None, None, *args, *constexprs)``
  (launch metadata and hooks are None while no launch hook is installed).

Keys. Triton picks its compiled kernel by, per non-constexpr argument, a tensor's dtype and whether its
data pointer is a multiple of 16; an int's type (i32 / i64 / u64 by range), whether it is 1 (then it is a
constexpr) and whether it is a multiple of 16; only the type of a float, bool or None; plus the
constexprs, the launch options, the debug / instrumentation knobs and the device. Each kernel keeps two
dicts per argument-type pattern, with keys at least as fine as that, so equal keys mean the same kernel:

- *exact*: ints by value, tensors by (dtype, aligned), constexprs by (name, value) and their types,
  device, knobs. A model's shapes repeat, and an int costs nothing to key by value: the hit path.
- *class*: ints by the class above (``int_class``); on an exact miss (a new shape) it finds the launcher
  without a trip through ``kernel.run``. tests/ops/test_launch.py checks it against the installed
  triton's ``native_specialize_impl``.

Falls back to ``kernel[grid](...)`` (logged once per reason at DEBUG) under Dynamo tracing (which turns
``kernel[grid]`` into a graph node), for a kernel that is not a plain ``JITFunction`` (interpreter,
``wrap_triton``, autotuner), a triton release other than those read for this module, ROCm, triton's
interpreter switched on, CPU tensors, argument types other than tensor / int / float / bool / None, a
constexpr passed by position, a grid that is not a tuple, launch hooks, pre-run hooks or a
stages-inspection hook installed, a global the kernel uses that has changed (triton
raises), and any exception while building a key or an entry. The device of the first tensor argument is
made current around the launch (``kernel[grid]`` launches on the current device); the stream is that
device's current stream, as in triton. Not noticed, as in Inductor's launchers: a kernel source swapped
with ``_unsafe_update_src`` or another active triton driver; call ``clear()``.

This module imports triton.
"""
from __future__ import annotations

import logging
import threading
import types
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch
import triton
from triton.runtime.jit import JITFunction

try:
    from triton import knobs  # triton >= 3.4; older releases take kernel[grid] (version gate below)
except ImportError:  # pragma: no cover - old triton
    knobs = None

_log = logging.getLogger("torchpatches")

#: triton releases whose ``JITFunction.run``, ``CompiledKernel`` launcher call and argument
#: specialisation were read for this module (3.6.0, 3.7.1, 3.8.0, 3.9.0).
SUPPORTED_TRITON = ((3, 6), (3, 7), (3, 8), (3, 9))
#: Entries of one exact dict before it is emptied (a caller with ever new shapes).
MAX_EXACT = 1024
#: Argument-type patterns kept per kernel.
MAX_PATTERNS = 64

_NO_CONSTEXPRS: Mapping[str, Any] = types.MappingProxyType({})
_HookChain = getattr(knobs, "HookChain", None)
# A knob JITFunction.run puts in the compile options from 3.9 on.
_HAS_FPSAN = knobs is not None and hasattr(type(knobs.compilation), "fpsan_homomorphic_casts")

# Dynamo traces ``kernel[grid](...)`` into a Triton-kernel node; it cannot trace this module's caches.
_is_compiling: Callable[[], bool] = getattr(torch.compiler, "is_dynamo_compiling", lambda: False)
# Device queries, bound at the first CUDA launch (tests replace them to run the fast path on CPU).
_device_index: Callable[[torch.Tensor], int] = torch.Tensor.get_device
_current_device: Optional[Callable[[], int]] = None
_raw_stream: Optional[Callable[[int], int]] = None


def int_class(v: int) -> Any:
    """The class triton specialises a Python int argument by (``handle_long_type``, specialize.cc):
    1 becomes a constexpr; other values by (type by range, multiple of 16). Out of u64 range triton
    raises, so that class never gets an entry."""
    if v == 1:
        return 1
    if -0x80000000 <= v <= 0x7FFFFFFF:
        ty = "i32"
    elif -0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF:
        ty = "i64"
    elif 0 <= v <= 0xFFFFFFFFFFFFFFFF:
        ty = "u64"
    else:
        ty = "overflow"
    return ty, (v & 15) == 0


def _triton_version() -> Tuple[int, ...]:
    try:
        return tuple(int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return ()


def _environment_reason() -> Optional[str]:
    """Why this process cannot use the fast path at all (None: it can). Read once per site."""
    if _triton_version() not in SUPPORTED_TRITON or knobs is None:
        return f"triton {triton.__version__} is not one of the releases read for the fast path"
    if torch.version.hip is not None:
        return "ROCm: triton's AMD backend specialises tensors differently"
    if knobs.runtime.interpret:
        return "TRITON_INTERPRET is set"
    return None


_logged: set = set()


def _debug_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        _log.debug("torchpatches launch: kernel[grid] fallback: %s", reason)


def _knob_state(kernel: JITFunction) -> Optional[tuple]:
    """The knobs ``JITFunction.run`` adds to the compile options, or None while a launch hook, a
    pre-run hook or a stages-inspection hook would make ``kernel[grid]`` do more than launch."""
    rt = knobs.runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    # None or an empty HookChain: kernel[grid] calls nothing (an empty chain is a no-op call)
    if ((enter is not None and (enter.__class__ is not _HookChain or enter.calls))
            or (leave is not None and (leave.__class__ is not _HookChain or leave.calls))
            or kernel.pre_run_hooks or getattr(rt, "add_stages_inspection_hook", None) is not None):
        return None
    comp = knobs.compilation
    if _HAS_FPSAN:
        return kernel.debug, rt.debug, comp.instrumentation_mode, comp.fpsan_homomorphic_casts
    return kernel.debug, rt.debug, comp.instrumentation_mode


def _globals_unchanged(checks: tuple) -> bool:
    missing = _globals_unchanged  # a sentinel no kernel global can equal
    return all(g.get(name, missing) == val for g, name, val in checks)


class _Pattern:
    """One argument-type pattern of a kernel: its key functions and its two dicts."""

    __slots__ = ("types", "first", "exact_key", "class_key", "exact", "classes")

    def __init__(self, arg_types: tuple, first: int, exact_key: Callable[..., tuple],
                 class_key: Callable[..., tuple]):
        self.types = arg_types
        self.first = first  # index of the first tensor argument: its device is the launch device
        self.exact_key = exact_key
        self.class_key = class_key
        self.exact: Dict[tuple, tuple] = {}
        self.classes: Dict[tuple, tuple] = {}


def _key_functions(kinds: Sequence[str]) -> Tuple[Callable[..., tuple], Callable[..., tuple]]:
    """Generated ``exact_key(*args)`` and ``class_key(*args)`` of one pattern: straight-line code, no
    loop or branch per argument (a generic key costs most of what the fast path saves).

    A tensor position keys (dtype, 16-byte aligned) and raises for anything without ``dtype`` /
    ``data_ptr`` (what triton treats as a tensor); every other position keys its class first, so
    arguments of another pattern never equal a stored key (True == 1, 16.0 == 16), then an int's
    value (exact) or class (``int_class``)."""
    exact, classes = [], []
    for i, kind in enumerate(kinds):
        a = f"a{i}"
        if kind == "tensor":
            part = f"{a}.dtype, ({a}.data_ptr() & 15) == 0"
            exact.append(part)
            classes.append(part)
        elif kind == "int":
            exact.append(f"{a}.__class__, {a}")
            classes.append(f"{a}.__class__, int_class({a})")
        else:
            exact.append(f"{a}.__class__")
            classes.append(f"{a}.__class__")
    params = ", ".join(f"a{i}" for i in range(len(kinds)))
    src = (f"def exact_key({params}):\n    return ({''.join(p + ', ' for p in exact)})\n"
           f"def class_key({params}):\n    return ({''.join(p + ', ' for p in classes)})\n")
    scope: Dict[str, Any] = {"int_class": int_class}
    exec(src, scope)  # noqa: S102 - source built above from fixed fragments and argument indices
    return scope["exact_key"], scope["class_key"]


def _no_key(*args: Any) -> tuple:
    raise LookupError("no pattern yet")


_NO_PATTERN = _Pattern((), 0, _no_key, _no_key)


class _Site:
    """Launch state of one ``JITFunction``: its argument-type patterns, each with its caches."""

    def __init__(self, kernel: JITFunction):
        self.kernel = kernel
        self.params = [(p.name, p.is_constexpr, p.has_default, p.default) for p in kernel.params]
        self.names = {p.name: p.is_constexpr for p in kernel.params}
        self.patterns: Dict[tuple, Optional[_Pattern]] = {}
        self.last = _NO_PATTERN  # the pattern of the previous fast launch: tried first
        self.lock = threading.RLock()
        self.compiles = 0  # launches that went through kernel.run and left an entry
        self.fallbacks = 0  # launches handed to kernel[grid]

    def launch(self, grid: Any, args: Sequence[Any], constexprs: Mapping[str, Any]) -> None:
        """The hot path: one key, one dict lookup, the launcher. Anything unusual (another pattern, a
        new key, CPU tensors, another current device, hooks) misses the dict and takes ``slow``."""
        pat = self.last
        try:
            dev = _device_index(args[pat.first])
            key = (pat.exact_key(*args), dev, _current_device(), tuple(constexprs.items()),
                   tuple(map(type, constexprs.values())), _knob_state(self.kernel))
            launcher, function, metadata, tail, checks = pat.exact[key]
            n = len(grid)
            g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
        except Exception:
            return self.slow(grid, args, constexprs)
        if checks and not _globals_unchanged(checks):
            return self.fallback(grid, args, constexprs, "a global used by the kernel changed")
        launcher(g0, g1, g2, _raw_stream(dev), function, metadata, None, None, None, *args, *tail)
        return None

    def slow(self, grid: Any, args: Sequence[Any], constexprs: Mapping[str, Any]) -> None:
        """Find the pattern by the argument types, check device and hooks, then the exact dict, the
        class dict, or ``kernel.run``."""
        pat = self.pattern(args)
        if pat is None:
            return self.fallback(grid, args, constexprs, "argument types outside tensor/int/float/bool/None")
        dev = _device_index(args[pat.first])
        if dev < 0:
            return self.fallback(grid, args, constexprs, "CPU tensors")
        if dev != _current_device():
            with torch.cuda.device(dev):  # triton launches on the current device
                return self.launch(grid, args, constexprs)
        state = _knob_state(self.kernel)
        if state is None or type(grid) is not tuple or not 1 <= len(grid) <= 3:
            return self.fallback(grid, args, constexprs, "launch/pre-run hooks installed, or a grid that is not a tuple")
        try:
            key = (pat.exact_key(*args), dev, dev, tuple(constexprs.items()),
                   tuple(map(type, constexprs.values())), state)
            entry = pat.exact.get(key)
        except Exception as e:  # e.g. an unhashable constexpr, a tensor without storage
            return self.fallback(grid, args, constexprs, f"key: {type(e).__name__}: {e}")
        self.last = pat
        if entry is None:
            entry = self.miss(pat, key, grid, args, constexprs)
            if entry is None:
                return None  # launched by kernel.run
        launcher, function, metadata, tail, checks = entry
        if checks and not _globals_unchanged(checks):
            return self.fallback(grid, args, constexprs, "a global used by the kernel changed")
        n = len(grid)
        launcher(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _raw_stream(dev), function, metadata,
                 None, None, None, *args, *tail)
        return None

    def fallback(self, grid: Any, args: Sequence[Any], constexprs: Mapping[str, Any], reason: str) -> None:
        self.fallbacks += 1
        _debug_once(reason)
        self.kernel[grid](*args, **constexprs)

    def pattern(self, args: Sequence[Any]) -> Optional[_Pattern]:
        arg_types = tuple(map(type, args))
        pat = self.patterns.get(arg_types, False)
        if pat is not False:
            return pat
        with self.lock:
            pat = self.patterns.get(arg_types, False)
            if pat is False:
                pat = self.build_pattern(arg_types)
                if len(self.patterns) < MAX_PATTERNS:
                    self.patterns[arg_types] = pat
            return pat

    def build_pattern(self, arg_types: Tuple[type, ...]) -> Optional[_Pattern]:
        if len(arg_types) > len(self.params):
            return None  # kernel[grid] raises its own error
        kinds = []
        for (_, is_constexpr, _, _), t in zip(self.params, arg_types):
            if is_constexpr:
                return None  # a constexpr by position: keep it simple, let kernel[grid] take it
            if issubclass(t, torch.Tensor):
                kinds.append("tensor")
            elif t is int:
                kinds.append("int")
            elif t in (float, bool, type(None)):
                kinds.append("type")  # triton: fp32 / u1 / constexpr None whatever the value
            else:
                return None
        if "tensor" not in kinds:
            return None
        return _Pattern(arg_types, kinds.index("tensor"), *_key_functions(kinds))

    def miss(self, pat: _Pattern, key: tuple, grid: tuple, args: Sequence[Any],
             constexprs: Mapping[str, Any]) -> Optional[tuple]:
        """The entry for a new exact key: from the class dict, else by launching through ``kernel.run``
        (then None: already launched). Under the lock, so a class compiles once across threads."""
        with self.lock:
            entry = pat.exact.get(key)
            if entry is not None:
                return entry
            try:
                class_key = (pat.class_key(*args),) + key[1:]
            except Exception as e:
                _debug_once(f"class key: {type(e).__name__}: {e}")
                class_key = None
            entry = pat.classes.get(class_key) if class_key is not None else None
            if entry is None:
                compiled = self.kernel.run(*args, grid=grid, warmup=False, **constexprs)
                entry = self.entry(compiled, len(args), constexprs)
                if entry is not None and class_key is not None:
                    self.compiles += 1
                    if len(pat.classes) < MAX_EXACT:
                        pat.classes[class_key] = entry
                    self.remember(pat, key, entry)
                return None
            self.remember(pat, key, entry)
            return entry

    @staticmethod
    def remember(pat: _Pattern, key: tuple, entry: tuple) -> None:
        if len(pat.exact) >= MAX_EXACT:
            pat.exact = {}  # readers holding the old dict finish with it
        pat.exact[key] = entry

    def entry(self, compiled: Any, nargs: int, constexprs: Mapping[str, Any]) -> Optional[tuple]:
        """(launcher, function, packed metadata, trailing constexpr/default values, global checks) of
        a ``CompiledKernel``; None (logged) where it is not what triton 3.6-3.9 return."""
        try:
            for name in constexprs:
                if name in self.names and not self.names[name]:
                    raise TypeError(f"non-constexpr argument {name!r} passed by name")
            launcher = compiled.run  # the launcher object (property: loads the module on this device)
            function, metadata = compiled.function, compiled.packed_metadata
            if function is None or not callable(launcher):
                raise TypeError(f"{type(compiled).__name__} has no loaded function")
            tail = []
            for name, _, has_default, default in self.params[nargs:]:
                if name in constexprs:
                    tail.append(constexprs[name])
                elif has_default:
                    tail.append(default)
                else:
                    raise TypeError(f"missing argument {name!r}")
            checks = tuple((g, name, val) for (name, _), (val, g) in self.kernel.used_global_vals.items())
            return launcher, function, metadata, tuple(tail), checks
        except Exception as e:
            _debug_once(f"entry for {self.kernel}: {type(e).__name__}: {e}")
            return None


class _Fallback:
    """The site of a kernel that always goes through ``kernel[grid]`` (the reason is logged once)."""

    def __init__(self, kernel: Any, reason: str):
        self.kernel = kernel
        self.reason = reason

    def launch(self, grid: Any, args: Sequence[Any], constexprs: Mapping[str, Any]) -> None:
        self.kernel[grid](*args, **constexprs)


_SITES: Dict[int, Any] = {}  # id(kernel) -> _Site or _Fallback (each holds its kernel: the id stays taken)
_SITES_LOCK = threading.Lock()
_ENV: list = []  # [reason or None], computed at the first JITFunction launch


def _bind_cuda() -> None:
    global _current_device, _raw_stream
    from triton.runtime import driver

    # The same queries kernel[grid] makes (driver.active.get_current_device / get_current_stream);
    # torch._C._cuda_getDevice skips current_device()'s lazy-init check (CUDA is up: we hold a CUDA tensor).
    _current_device = getattr(torch._C, "_cuda_getDevice", None) or driver.active.get_current_device
    _raw_stream = driver.active.get_current_stream


def _site_for(kernel: Any) -> Optional[Any]:
    """The launch site of a ``JITFunction`` (created once); None for anything else (not kept: a
    ``wrap_triton`` wrapper may be a new object on every call)."""
    if type(kernel) is not JITFunction:
        return None
    with _SITES_LOCK:
        site = _SITES.get(id(kernel))
        if site is not None and site.kernel is kernel:
            return site
        if not _ENV:
            _ENV.append(_environment_reason())
        reason = _ENV[0]
        if reason is None and any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)
                                  for p in kernel.signature.parameters.values()):
            reason = f"{kernel}: *args or keyword-only parameters"
        if reason is not None:
            _debug_once(reason)
            site = _Fallback(kernel, reason)
        else:
            if _raw_stream is None and torch.cuda.is_available():
                _bind_cuda()
            site = _Site(kernel)
        _SITES[id(kernel)] = site
        return site


def launch(kernel: Any, grid: Tuple[int, ...], args: Sequence[Any],
           constexprs: Mapping[str, Any] = _NO_CONSTEXPRS) -> None:
    """``kernel[grid](*args, **constexprs)``, through the kernel's cached launcher where that is proven
    to pick the same compiled kernel (module docstring). ``args``: the leading positional (non-constexpr)
    arguments; ``constexprs``: constexpr parameters and launch options (``num_warps``...) by name."""
    if _is_compiling():  # first: Dynamo then sees nothing but kernel[grid]
        kernel[grid](*args, **constexprs)
        return
    site = _SITES.get(id(kernel))
    if site is None or site.kernel is not kernel:
        site = _site_for(kernel)
        if site is None:
            kernel[grid](*args, **constexprs)
            return
    site.launch(grid, args, constexprs)


def clear() -> None:
    """Forget every cached launcher and the environment check (tests; after swapping a kernel's source)."""
    with _SITES_LOCK:
        _SITES.clear()
        _ENV.clear()
        _logged.clear()


def info(kernel: Any) -> Dict[str, int]:
    """Counters of one kernel's launch site (tests, benchmarks): compiles, fallbacks, cached entries."""
    site = _SITES.get(id(kernel))
    if not isinstance(site, _Site) or site.kernel is not kernel:
        return {"compiles": 0, "fallbacks": 0, "exact": 0, "classes": 0, "patterns": 0}
    pats = [p for p in site.patterns.values() if p is not None]
    return {"compiles": site.compiles, "fallbacks": site.fallbacks, "exact": sum(len(p.exact) for p in pats),
            "classes": sum(len(p.classes) for p in pats), "patterns": len(site.patterns)}
