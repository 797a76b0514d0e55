"""torchpatches.ops._runtime.launch: cached Triton launches.

The promise: ``launch(kernel, grid, args, constexprs)`` runs the compiled kernel that
``kernel[grid](*args, **constexprs)`` would run, on the same stream. On CPU the compiled launcher is
replaced by a recorder and ``kernel.run`` by an emulation of triton's own cache (keyed by the installed
triton's ``native_specialize_impl`` through its binder), so every launch can be checked to use the
kernel triton would have picked: each case below gives a wrong kernel if the key were coarser than
triton's. The fallback (interpreter, unknown triton, CPU tensors, hooks) is checked against
``kernel[grid]``; GPU tests (real kernels, streams, devices) run where CUDA is.
"""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from torchpatches.ops._runtime import launch as _launch  # noqa: E402

HYP = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), max_examples=200)
SUPPORTED = _launch._triton_version() in _launch.SUPPORTED_TRITON
needs_supported = pytest.mark.skipif(not SUPPORTED, reason=f"triton {triton.__version__}: fast path off")
BOUNDARY_INTS = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -(2**31),
                 -(2**31) - 1, -(2**31) - 16, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16, 2**64 - 1,
                 -(2**63), -(2**63) - 1, 2**64, 2**70]


def _probe(x_ptr, y_ptr, n, stride, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 7):
    pass  # never compiled: the CPU tests emulate compilation


def _make_probe() -> JITFunction:
    return JITFunction(_probe)  # not triton.jit: that gives an InterpretedFunction under TRITON_INTERPRET=1


def _spec_of(value: Any) -> Tuple[Any, ...]:
    """Triton's specialisation of one non-constexpr argument; an exception's type where it refuses."""
    from triton._C.libtriton import native_specialize_impl

    try:
        return tuple(native_specialize_impl(BaseBackend, value, False, True, True))
    except Exception as e:
        return ("raises", type(e).__name__)


def _translate(v: int) -> Any:
    """triton's (type, key) of an int in int_class's terms."""
    spec = _spec_of(v)
    if spec == ("constexpr", 1):
        return 1
    if spec[0] == "raises":
        return "overflow", (v & 15) == 0
    return spec[0], spec[1] == "D"


@pytest.mark.parametrize("v", BOUNDARY_INTS)
def test_int_class_is_triton_class_at_boundaries(v: int) -> None:
    assert _launch.int_class(v) == _translate(v)


@settings(**HYP)
@given(st.one_of(st.integers(-(2**65), 2**65), st.integers(-64, 64),
                 st.sampled_from(BOUNDARY_INTS).flatmap(lambda b: st.integers(b - 40, b + 40))))
def test_int_class_is_triton_class(v: int) -> None:
    assert _launch.int_class(v) == _translate(v)


# -- the fast path on CPU: a recorder for the launcher, an emulation of triton's compile cache ---------


class _FakeCompiled:
    """A CompiledKernel stand-in: its launcher records (thread, spec, launcher arguments)."""

    def __init__(self, spec: str, log: List[tuple]):
        self.spec = spec
        self.function = object()
        self.packed_metadata = ("meta", spec)
        self.run = lambda *a: log.append((threading.get_ident(), self.spec, a))


class _Triton:
    """``kernel.run`` as triton does it, minus the GPU: key by the real binder, one compiled kernel per key."""

    def __init__(self, kernel: JITFunction):
        self.binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
        self.compiled: Dict[str, _FakeCompiled] = {}
        self.launches: List[tuple] = []  # (thread, spec of the kernel that ran, launcher arguments)
        self.expected: List[tuple] = []  # (thread, spec of the kernel the call's arguments select)
        self.compiles = 0
        self.lock = threading.Lock()

    def spec(self, *args: Any, **kw: Any) -> str:
        kw["debug"] = kw.get("debug", False) or triton.knobs.runtime.debug  # as JITFunction.run
        _, specialization, options = self.binder(*args, **kw)
        return str(specialization) + str(sorted(options.items()))

    def run(self, *args: Any, grid: Any, warmup: bool, **kw: Any) -> _FakeCompiled:
        spec = self.spec(*args, **kw)
        with self.lock:
            if spec not in self.compiled:
                self.compiles += 1
                self.compiled[spec] = _FakeCompiled(spec, self.launches)
        c = self.compiled[spec]
        n = len(grid)
        c.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, 0, c.function, c.packed_metadata,
              None, None, None, *args, kw.get("BLOCK"), kw.get("MODE", 7))
        return c


def _fake_cuda(mp: pytest.MonkeyPatch) -> Tuple[JITFunction, _Triton]:
    """A probe kernel whose launches run on CPU tensors as if they were on CUDA device 0 (stream 1234)."""
    if not SUPPORTED:
        pytest.skip(f"triton {triton.__version__}: fast path off")
    mp.delenv("TRITON_INTERPRET", raising=False)
    kernel = _make_probe()
    tri = _Triton(kernel)
    mp.setattr(kernel, "run", tri.run, raising=False)
    mp.setattr(_launch, "_device_index", lambda t: 0)
    mp.setattr(_launch, "_current_device", lambda: 0)
    mp.setattr(_launch, "_raw_stream", lambda d: 1234)
    _launch.clear()
    return kernel, tri


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Tuple[JITFunction, _Triton]:
    yield _fake_cuda(monkeypatch)
    _launch.clear()


def _args(x: torch.Tensor, y: torch.Tensor, n: int = 64, stride: Any = 64, scale: Any = 0.5, flag: Any = True):
    return (x, y, n, stride, scale, flag)


def _launch_probe(kernel: JITFunction, tri: _Triton, args: tuple, **cx: Any) -> None:
    cx.setdefault("BLOCK", 16)
    cx.setdefault("num_warps", 4)
    tri.expected.append((threading.get_ident(), tri.spec(*args, **cx)))
    _launch.launch(kernel, (3, 2), args, cx)


def _check_all(tri: _Triton) -> None:
    """Every launch ran the compiled kernel its own arguments select in triton (per thread, in order)."""
    for ident in {t for t, _ in tri.expected}:
        ran = [spec for t, spec, _ in tri.launches if t == ident]
        assert ran == [spec for t, spec in tri.expected if t == ident]


def test_second_launch_calls_the_launcher(fake) -> None:
    kernel, tri = fake
    x, y = torch.zeros(64), torch.zeros(64)
    _launch_probe(kernel, tri, _args(x, y))
    _launch_probe(kernel, tri, _args(x, y))
    assert tri.compiles == 1 and len(tri.launches) == 2
    assert _launch.info(kernel)["compiles"] == 1
    _, spec, a = tri.launches[1]
    c = tri.compiled[spec]
    # the call JITFunction.run ends with: grid, stream, function, metadata, no hooks, args, constexprs
    assert a[:9] == (3, 2, 1, 1234, c.function, c.packed_metadata, None, None, None)
    assert a[9:15] == _args(x, y) and a[15:] == (16, 7)  # MODE: its default
    _launch_probe(kernel, tri, _args(x, y), MODE=3)
    assert tri.launches[-1][2][15:] == (16, 3)
    _check_all(tri)


def _distinct(kernel, tri, first: tuple, second: tuple, cx1: dict = {}, cx2: dict = {}) -> None:
    """``second`` must not reuse ``first``'s kernel: triton specialises them apart."""
    _launch_probe(kernel, tri, first, **cx1)
    _launch_probe(kernel, tri, second, **cx2)
    assert tri.expected[0][1] != tri.expected[1][1]  # the case is a real one: triton tells them apart
    _launch_probe(kernel, tri, second, **cx2)
    _launch_probe(kernel, tri, first, **cx1)
    assert tri.compiles == 2 and len(tri.launches) == 4
    _check_all(tri)


def test_misaligned_tensor_is_another_kernel(fake) -> None:
    kernel, tri = fake
    buf = torch.zeros(80, dtype=torch.bfloat16)
    _distinct(kernel, tri, _args(buf[:64], buf[:64]), _args(buf[1:65], buf[:64]))


def test_dtype_is_another_kernel(fake) -> None:
    kernel, tri = fake
    x = torch.zeros(64)
    _distinct(kernel, tri, _args(x, x), _args(x.to(torch.float16), x))


@pytest.mark.parametrize("a,b", [(2, 1), (16, 17), (17, 1), (32, 2**31), (2**31 - 16, 2**31),
                                 (2**63 - 16, 2**63), (-16, -17)])
def test_int_classes_are_other_kernels(fake, a: int, b: int) -> None:
    kernel, tri = fake
    x = torch.zeros(64)
    _distinct(kernel, tri, _args(x, x, n=a), _args(x, x, n=b))


@pytest.mark.parametrize("a,b", [(16, 4096), (17, 33), (2**31, 2**32 + 16), (-32, 4096)])
def test_same_int_class_reuses_the_kernel(fake, a: int, b: int) -> None:
    kernel, tri = fake
    x = torch.zeros(64)
    _launch_probe(kernel, tri, _args(x, x, n=a))
    _launch_probe(kernel, tri, _args(x, x, n=b))  # a new exact key, found in the class dict
    assert tri.expected[0][1] == tri.expected[1][1]  # one triton kernel for both
    assert tri.compiles == 1 and len(tri.launches) == 2
    assert tri.launches[1][2][9:15] == _args(x, x, n=b)  # with its own arguments
    assert _launch.info(kernel)["exact"] == 2 and _launch.info(kernel)["classes"] == 1
    _check_all(tri)


@pytest.mark.parametrize("cx1,cx2", [({"MODE": 1}, {"MODE": 2}), ({"MODE": 1}, {"MODE": True}),
                                     ({"MODE": 1}, {"MODE": 1.0}), ({"num_warps": 4}, {"num_warps": 8})])
def test_constexprs_and_options_are_other_kernels(fake, cx1: dict, cx2: dict) -> None:
    kernel, tri = fake
    x = torch.zeros(64)
    _distinct(kernel, tri, _args(x, x), _args(x, x), cx1, cx2)


@pytest.mark.parametrize("a,b", [(1, True), (16, 16.0), (0, False), (0.5, 1)])
def test_argument_types_are_other_kernels(fake, a: Any, b: Any) -> None:
    kernel, tri = fake
    x = torch.zeros(64)
    # flag is 1 / True / ..., stride 16 / 16.0: equal in Python, not to triton
    first, second = _args(x, x, stride=a), _args(x, x, stride=b)
    _distinct(kernel, tri, first, second)


def test_float_and_bool_values_share_a_kernel(fake) -> None:
    kernel, tri = fake
    x = torch.zeros(64)
    _launch_probe(kernel, tri, _args(x, x, scale=0.5, flag=True))
    _launch_probe(kernel, tri, _args(x, x, scale=3.0, flag=False))
    assert tri.compiles == 1 and len(tri.launches) == 2
    _check_all(tri)


@settings(**{**HYP, "max_examples": 60})
@given(st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.integers(0, 8),
                          st.sampled_from(BOUNDARY_INTS[:20] + [48, 4096, 4097]), st.sampled_from([16, 24, 1]),
                          st.sampled_from([1, 2])), min_size=1, max_size=12))
def test_random_sequences_always_run_tritons_kernel(calls: list) -> None:
    mp = pytest.MonkeyPatch()  # not the fixture: hypothesis runs many examples per test call
    try:
        kernel, tri = _fake_cuda(mp)
        buf = torch.zeros(128, dtype=torch.float32)
        for dtype, off, n, stride, mode in calls:
            x = buf.to(dtype)[off:off + 64]
            _launch_probe(kernel, tri, _args(x, buf, n=n, stride=stride), MODE=mode)
        assert len(tri.launches) == len(calls)
        _check_all(tri)
    finally:
        mp.undo()
        _launch.clear()


def test_threads_share_one_cache(fake) -> None:
    kernel, tri = fake
    buf = torch.zeros(80, dtype=torch.bfloat16)
    cases = [_args(buf[o:o + 64], buf[:64], n=n) for o in (0, 1, 8) for n in (1, 16, 17, 2**31)]
    start = threading.Barrier(8)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        start.wait()
        for _ in range(300):
            _launch_probe(kernel, tri, rng.choice(cases))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))  # re-raises a thread's exception
    assert len(tri.launches) == 8 * 300
    assert tri.compiles == len({tri.spec(*c, BLOCK=16, num_warps=4) for c in cases})  # each class once
    assert _launch.info(kernel)["compiles"] == tri.compiles
    _check_all(tri)


def test_launch_hooks_and_pre_run_hooks_fall_back(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel, tri = fake
    x = torch.zeros(64)
    _launch_probe(kernel, tri, _args(x, x))
    seen: List[Any] = []
    hook = seen.append
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        _launch_probe(kernel, tri, _args(x, x))
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert _launch.info(kernel)["fallbacks"] == 1  # kernel[grid] ran it: triton calls the hook
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    try:
        _launch_probe(kernel, tri, _args(x, x))
    finally:
        kernel.pre_run_hooks.clear()
    assert _launch.info(kernel)["fallbacks"] == 2
    _launch_probe(kernel, tri, _args(x, x))
    assert _launch.info(kernel)["fallbacks"] == 2 and len(tri.launches) == 4


def test_debug_knob_is_another_kernel(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel, tri = fake
    x = torch.zeros(64)
    _launch_probe(kernel, tri, _args(x, x))
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    _launch_probe(kernel, tri, _args(x, x))
    assert tri.compiles == 2  # triton's options carry debug: a new kernel, not the cached one


def test_changed_global_falls_back(fake) -> None:
    kernel, tri = fake
    x = torch.zeros(64)
    scope = {"G": 1}
    _launch_probe(kernel, tri, _args(x, x))
    site = _launch._SITES[id(kernel)]
    pat = site.last
    for key, (launcher, function, metadata, tail, _) in list(pat.exact.items()):
        pat.exact[key] = (launcher, function, metadata, tail, ((scope, "G", 1),))
    _launch_probe(kernel, tri, _args(x, x))
    assert _launch.info(kernel)["fallbacks"] == 0
    scope["G"] = 2  # triton would raise "Global variable G has changed": kernel[grid] decides
    _launch_probe(kernel, tri, _args(x, x))
    assert _launch.info(kernel)["fallbacks"] == 1


@pytest.mark.parametrize("bad", ["list grid", "grid fn", "non-constexpr by name", "np int", "positional constexpr"])
def test_unusual_calls_fall_back_to_kernel_grid(fake, bad: str) -> None:
    kernel, tri = fake
    x = torch.zeros(64)
    args, cx, grid = _args(x, x), {"BLOCK": 16}, (3, 2)
    if bad == "list grid":
        grid = [3, 2]
    elif bad == "grid fn":
        grid = lambda meta: (3, 2)  # noqa: E731
    elif bad == "non-constexpr by name":
        args, cx = args[:5], {"flag": True, "BLOCK": 16}
    elif bad == "np int":
        np = pytest.importorskip("numpy")
        args = _args(x, x, n=np.int64(64))
    elif bad == "positional constexpr":
        args = args + (16,)
        cx = {}
    for _ in range(2):
        try:
            _launch.launch(kernel, grid, args, cx)
        except Exception:
            pass  # what kernel[grid] raises (the emulation does not take every form) is not ours to judge
    info = _launch.info(kernel)
    assert info["compiles"] == 0
    assert info["exact"] == 0


def test_dynamo_tracing_sees_only_kernel_grid(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    """While Dynamo traces, launch is kernel[grid] before touching any cache (Dynamo turns that call into
    a Triton-kernel node; it could not trace the caches)."""
    kernel, tri = fake
    x = torch.zeros(64)
    monkeypatch.setattr(_launch, "_is_compiling", lambda: True)

    class Untouchable(dict):
        def get(self, *a: Any) -> Any:
            raise AssertionError("a cache was used while Dynamo traces")

    monkeypatch.setattr(_launch, "_SITES", Untouchable())
    for _ in range(2):
        _launch_probe(kernel, tri, _args(x, x))
    assert len(tri.launches) == 2 and tri.compiles == 1
    _check_all(tri)


def test_cpu_tensors_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    if not SUPPORTED:
        pytest.skip("fast path off")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _launch.clear()
    kernel = _make_probe()
    tri = _Triton(kernel)
    monkeypatch.setattr(kernel, "run", tri.run, raising=False)
    x = torch.zeros(64)
    _launch_probe(kernel, tri, _args(x, x))
    _launch_probe(kernel, tri, _args(x, x))
    assert _launch.info(kernel)["fallbacks"] == 2 and len(tri.launches) == 2
    _launch.clear()


@pytest.mark.parametrize("why", ["TRITON_INTERPRET", "unknown triton"])
def test_environment_falls_back(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    if why == "TRITON_INTERPRET":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setattr(triton, "__version__", "3.99.0")
    _launch.clear()
    kernel = _make_probe()
    tri = _Triton(kernel)
    monkeypatch.setattr(kernel, "run", tri.run, raising=False)
    monkeypatch.setattr(_launch, "_device_index", lambda t: 0)
    monkeypatch.setattr(_launch, "_current_device", lambda: 0)
    x = torch.zeros(64)
    for _ in range(2):
        _launch_probe(kernel, tri, _args(x, x))
    assert len(tri.launches) == 2 and isinstance(_launch._SITES[id(kernel)], _launch._Fallback)
    _launch.clear()


def test_interpreted_kernel_results_equal_kernel_grid() -> None:
    """Under the interpreter (CI) ``launch`` is ``kernel[grid]``: the same results, bit for bit."""
    from triton.runtime.interpreter import InterpretedFunction

    from torchpatches.ops import _swiglu_triton

    kernel = _swiglu_triton._interpreted_kernel()
    assert isinstance(kernel, InterpretedFunction)
    g = torch.Generator().manual_seed(0)
    for F in (1, 16, 17):
        x = torch.randn(3, 2 * F + 5, generator=g).to(torch.bfloat16)[:, 1:2 * F + 1]  # odd offset and stride
        out_a, out_b = torch.empty(3, F, dtype=x.dtype), torch.empty(3, F, dtype=x.dtype)
        cx = dict(BLOCK=16 if F <= 16 else 32, KIND=1, LIBDEVICE=False, num_warps=1)
        grid = (3, 1 + (F - 1) // cx["BLOCK"])
        # the one-input form: gate and up are x's two halves (up at column offset F)
        kernel[grid](x, x, out_a, F, x.stride(0), x.stride(0), out_a.stride(0), F, **cx)
        _launch.launch(kernel, grid, (x, x, out_b, F, x.stride(0), x.stride(0), out_b.stride(0), F), cx)
        assert torch.equal(out_a.view(torch.int16), out_b.view(torch.int16))


# -- GPU: real kernels, streams, devices ---------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@triton.jit
def _scale_rows(x_ptr, o_ptr, N, x_sr, o_sr, alpha, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < N
    x = tl.load(x_ptr + row * x_sr + c, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * o_sr + c, (x * alpha).to(o_ptr.dtype.element_ty), mask=m)


def _rows_case(M: int, N: int, off: int, dtype: torch.dtype, device: str) -> Tuple[torch.Tensor, torch.Tensor]:
    base = torch.randn(M, N + off + 3, device=device).to(dtype)
    return base[:, off:off + N], torch.empty(M, N + off + 3, device=device, dtype=dtype)[:, off:off + N]


def _run_rows(fn, x: torch.Tensor, o: torch.Tensor, alpha: float = 1.5) -> None:
    M, N = x.shape
    block = 16 if N <= 16 else 64
    grid = (M, -(-N // block))
    if fn is None:
        _scale_rows[grid](x, o, N, x.stride(0), o.stride(0), alpha, BLOCK=block, num_warps=1)
    else:
        fn(_scale_rows, grid, (x, o, N, x.stride(0), o.stride(0), alpha), {"BLOCK": block, "num_warps": 1})


@needs_cuda
@needs_supported
@pytest.mark.parametrize("N", [1, 16, 17, 100])
@pytest.mark.parametrize("off", [0, 1, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_results_equal_kernel_grid(N: int, off: int, dtype: torch.dtype) -> None:
    x, o_ref = _rows_case(5, N, off, dtype, "cuda")
    o = o_ref.clone()
    _run_rows(None, x, o_ref)
    for _ in range(3):  # first call compiles, then the exact dict
        o.zero_()
        _run_rows(_launch.launch, x, o)
        torch.cuda.synchronize()
        assert torch.equal(o, o_ref)


@needs_cuda
@needs_supported
def test_gpu_fast_path_is_taken() -> None:
    _launch.clear()
    x, o = _rows_case(4, 64, 0, torch.float32, "cuda")
    for _ in range(5):
        _run_rows(_launch.launch, x, o)
    info = _launch.info(_scale_rows)
    assert info["compiles"] == 1 and info["fallbacks"] == 0 and info["exact"] == 1


@needs_cuda
@needs_supported
def test_gpu_side_stream_is_used() -> None:
    x, o = _rows_case(64, 4096, 0, torch.float32, "cuda")
    _run_rows(_launch.launch, x, o)  # compile outside the stream
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        o.zero_()
        x.fill_(2.0)
        _run_rows(_launch.launch, x, o)
    s.synchronize()  # ordered after the fill on s, done when s is: it ran on s
    assert torch.equal(o, torch.full_like(o, 3.0))


@needs_cuda
@needs_supported
def test_gpu_cuda_graph_capture() -> None:
    x, o = _rows_case(8, 256, 0, torch.float32, "cuda")
    _run_rows(_launch.launch, x, o)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _run_rows(_launch.launch, x, o, alpha=2.0)
    o.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(o, x * 2.0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@needs_supported
def test_gpu_device_guard() -> None:
    x, o = _rows_case(4, 64, 0, torch.float32, "cuda:1")
    ref = x * 1.5
    with torch.cuda.device(0):
        for _ in range(3):
            o.zero_()
            _run_rows(_launch.launch, x, o)  # kernel[grid] would launch on device 0
            assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    assert torch.equal(o, ref)
