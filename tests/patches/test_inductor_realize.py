"""inductor_realize: the decision function on constructed IR, equivalence of compiled programs
before/after the patch (outputs, kernels, loop nests, buffers, bytes), the Inductor cache key,
and the skip on every torch whose original is not 2.11's rule.

Which tests run is decided by the running torch's original ``StorageBox.should_realize_on_reuse``,
the way the patch itself decides: its fingerprint in the verified set (torch 2.11.0, 2.12.1) runs
the equivalence tests; any other (2.13.0, 2.14.1, 2.15.0, ...) runs the skip tests.

The programs and the measuring code are torchpatches._harness's (REALIZE_PROGRAMS, inductor_report),
which benchmarks/inductor_realize.py uses too, so the benchmark table and these assertions are about
the same programs.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch

import torchpatches
from torchpatches._core import cache_key as _cache_key
import harness
from torchpatches._core.gates import fingerprint, release_version
from torchpatches._core.slot import MARK_PATCH
from torchpatches._core.cache_key import cache_token
from torchpatches.patches._bodies import inductor_realize as realize_body
from torchpatches.patches._bodies.inductor_realize import materialize_is_cheaper
from torchpatches.patches.inductor_realize import FINGERPRINT_TORCH_2_11_0, FINGERPRINT_TORCH_2_13_0, ORIGINALS, PATCH

# The fast sessions of torch releases where the patch applies (2.12) select these by this marker.
pytestmark = pytest.mark.inductor_realize

NAME = "inductor_realize"
TARGET = "torch._inductor.ir:StorageBox.should_realize_on_reuse"
# The original's fingerprint and the fingerprint of this patch's own code (see _cache_key.cache_token).
TOKEN = cache_token(PATCH, PATCH.targets[0], FINGERPRINT_TORCH_2_11_0)
REPO = Path(__file__).resolve().parents[2]

TORCH_RELEASE = str(release_version(torch.__version__))


def _running_original() -> Callable[..., bool]:
    """This torch's own ``should_realize_on_reuse`` (importing Inductor applies the patch where it can)."""
    import torch._inductor.ir as ir

    with torchpatches.disabled(NAME):
        return ir.StorageBox.should_realize_on_reuse


ORIGINAL_FINGERPRINT = fingerprint(_running_original())
HAS_2_11_RULE = ORIGINAL_FINGERPRINT in PATCH.targets[0].fingerprints
needs_2_11_rule = pytest.mark.skipif(
    not HAS_2_11_RULE, reason=f"torch {torch.__version__}'s original is not 2.11's rule ({ORIGINAL_FINGERPRINT})")
needs_other_rule = pytest.mark.skipif(
    HAS_2_11_RULE, reason=f"torch {torch.__version__}'s original is 2.11's rule: the patch applies")


@pytest.fixture(scope="module")
def only_this_patch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Other patches off, a fresh Inductor cache directory; both restored afterwards.

    The directory is shared by this module's compiles so identical C++ kernels compile once;
    the FX-graph / AOTAutograd caches are off in every equivalence compile anyway.
    """
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    cache_dir = tmp_path_factory.mktemp("inductor-cache")
    with torchpatches.only(NAME), temporary_cache_dir(str(cache_dir)):
        yield cache_dir


@pytest.fixture(scope="module")
def original_and_patched() -> Tuple[Callable[..., bool], Callable[..., bool]]:
    """The original (as revert puts it back) and a replacement built from it (torch 2.11)."""
    import torch._inductor.ir as ir

    torchpatches.apply(NAME)
    with torchpatches.disabled(NAME):
        original = ir.StorageBox.should_realize_on_reuse
    assert ir.StorageBox.should_realize_on_reuse is not original
    return original, realize_body.make_replacement(original)


# ---- declaration, import cost, registry state -----------------------------------------------


def test_declaration() -> None:
    assert PATCH.name == NAME
    assert PATCH.inductor_cache_key
    assert dict(PATCH.requires) == {"torch": ">=2.11"}  # no upper bound: the fingerprint decides
    (target,) = PATCH.targets
    assert target.path == TARGET
    assert target.fingerprints == frozenset({FINGERPRINT_TORCH_2_11_0})
    assert FINGERPRINT_TORCH_2_13_0 not in target.fingerprints
    # Every measured release carries either 2.11's rule (verified) or another original (refused).
    assert {release for release, found in ORIGINALS.items() if found in target.fingerprints} == {"2.11.0", "2.12.1"}


def test_fingerprint_recorded_for_this_torch() -> None:
    """ORIGINALS (and the README / banner built from it) tells the truth about the running torch."""
    if TORCH_RELEASE not in ORIGINALS:
        pytest.skip(f"torch {TORCH_RELEASE} not measured yet: its original's fingerprint is {ORIGINAL_FINGERPRINT}")
    assert ORIGINAL_FINGERPRINT == ORIGINALS[TORCH_RELEASE]


def test_state_follows_the_fingerprint() -> None:
    """Applied exactly where the original is 2.11's rule; everywhere else skipped, naming the fingerprint."""
    import torch._inductor.ir as ir
    import torch.compiler.config as compiler_config

    status = torchpatches.status()[NAME]
    if HAS_2_11_RULE:
        assert status.state.value == "applied", status.reason
        bound = ir.StorageBox.should_realize_on_reuse
        # A replacement carries its target's __module__/__qualname__ (so pickle finds it by name): its
        # mark and its code say whose it is.
        assert getattr(bound, MARK_PATCH) == NAME
        assert bound.__code__.co_filename == realize_body.__file__
        return
    assert status.state.value == "skipped"
    assert f"fingerprint {ORIGINAL_FINGERPRINT}" in status.reason and FINGERPRINT_TORCH_2_11_0 in status.reason
    assert ir.StorageBox.should_realize_on_reuse is _running_original()
    assert "torchpatches" not in compiler_config.cache_key_tag


def test_importing_the_patch_module_does_not_import_inductor() -> None:
    code = "import sys, torchpatches.patches.inductor_realize; print('torch._inductor.ir' in sys.modules)"
    env = dict(os.environ, TORCHPATCHES_DISABLE="all")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("first", "second", "users", "expected"),
    [
        (8, 4, 2, False),  # 8*1 < 4*3
        (12, 4, 2, True),  # 12*1 >= 4*3: the boundary counts as "materialize"
        (8, 4, 3, True),  # 2 reads, 3 users: 8*2 >= 4*4, the residual-add case of pytorch#176994
        (2 * 4, 4, 100, True),
        (4, 4, 100, False),  # 1 read, any users: never (4*99 < 4*101)
        (0, 4, 3, None),  # unknown read size -> fallback
        (8, 0, 3, None),  # unknown output size -> fallback
    ],
)
def test_byte_rule(first: int, second: int, users: int, expected: Any) -> None:
    assert materialize_is_cheaper(first, second, users) is expected


@needs_2_11_rule
def test_fingerprint_and_signature_of_the_2_11_original(
    original_and_patched: Tuple[Callable[..., bool], Callable[..., bool]],
) -> None:
    original, _ = original_and_patched
    assert fingerprint(original) == FINGERPRINT_TORCH_2_11_0 == ORIGINAL_FINGERPRINT
    assert list(inspect.signature(original).parameters) == ["self", "users"]


@needs_2_11_rule
def test_applied_reverted_and_reapplied_by_identity(
    original_and_patched: Tuple[Callable[..., bool], Callable[..., bool]],
) -> None:
    import torch._inductor.ir as ir
    import torch.compiler.config as compiler_config

    original, _ = original_and_patched
    torchpatches.apply(NAME)
    assert torchpatches.status()[NAME].state.value == "applied"
    patched = ir.StorageBox.should_realize_on_reuse
    assert patched is not original and patched.__torchpatches_target__ == TARGET
    torchpatches.apply(NAME)  # idempotent: the same replacement stays
    assert ir.StorageBox.should_realize_on_reuse is patched
    # other applied Inductor patches (torch 2.11: inductor_opaque_strides, ...) hold tokens of their own
    assert TOKEN in _cache_key.key_component()
    assert TOKEN not in compiler_config.cache_key_tag  # the user's tag is theirs alone
    torchpatches.revert(NAME)
    try:
        assert torchpatches.status()[NAME].state.value == "disabled"
        assert ir.StorageBox.should_realize_on_reuse is original
        assert not any(token.startswith(f"torchpatches:{NAME}@") for token in _cache_key.key_component())
    finally:
        torchpatches.apply(NAME)
    assert ir.StorageBox.should_realize_on_reuse is not original


@needs_2_11_rule
def test_disable_env_keeps_the_original() -> None:
    code = textwrap.dedent(
        """
        import torch, torchpatches, torch._inductor.ir as ir
        from torchpatches._core.gates import fingerprint
        state = torchpatches.status()["inductor_realize"]
        print(state.state.value, fingerprint(ir.StorageBox.should_realize_on_reuse), repr(torch.compiler.config.cache_key_tag))
        """
    )
    env = dict(os.environ, TORCHPATCHES_DISABLE="inductor_realize", TORCH_COMPILE_CACHE_KEY_TAG="user")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.split() == ["disabled", FINGERPRINT_TORCH_2_11_0, "'user'"]


# ---- the decision function on constructed IR ------------------------------------------------


class _IRFactory:
    """Builds real Inductor IR (through Inductor's own lowerings) inside a GraphLowering context.

    The lightest V.graph we found: a GraphLowering of an empty FX graph with a ShapeEnv, whose
    ``graph_inputs`` we fill with InputBuffers. ``get_dep_size_hint``, ``sizevars`` and
    ``get_dtype`` then work exactly as during a real compile; nothing is compiled.
    """

    def __init__(self) -> None:
        from torch._inductor import ir
        from torch._inductor.graph import GraphLowering
        from torch._inductor.lowering import lowerings
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        graph = torch.fx.Graph()
        graph.output(())
        self.ir = ir
        self.lowerings = lowerings
        self.shape_env = ShapeEnv()
        self.graph = GraphLowering(torch.fx.GraphModule({}, graph), shape_env=self.shape_env)
        self._count = 0

    def input(self, *size: Any) -> Any:
        ir = self.ir
        self._count += 1
        name = f"in{self._count}"
        layout = ir.FixedLayout(torch.device("cpu"), torch.float32, list(size), ir.FlexibleLayout.contiguous_strides(list(size)))
        box = ir.TensorBox.create(ir.InputBuffer(name=name, layout=layout))
        self.graph.graph_inputs[name] = box
        return box

    def unbacked(self) -> Any:
        return self.shape_env.create_unbacked_symint().node.expr

    def add(self, *operands: Any) -> Any:
        aten = torch.ops.aten
        result = operands[0]
        for operand in operands[1:]:
            result = self.lowerings[aten.add.Tensor](result, operand)
        return result

    def unary(self, op: Any, x: Any) -> Any:
        return self.lowerings[op](x)


def _sum_rows(f: _IRFactory) -> Any:
    x = f.input(64, 64)
    loader = x.make_loader()
    return f.ir.Reduction.create(
        device=torch.device("cpu"),
        dst_dtype=torch.float32,
        src_dtype=torch.float32,
        inner_fn=lambda index, rindex: loader([index[0], rindex[0]]),
        ranges=[64],
        reduction_ranges=[64],
        reduction_type="sum",
    )


def _long_chain(f: _IRFactory) -> Any:
    h = f.input(64, 64)
    for _ in range(40):  # > config.realize_opcount_threshold (30) ops, one read
        h = f.lowerings[torch.ops.aten.add.Tensor](h, 1.0)
    return h


def _three_lookups_in_one_table(f: _IRFactory) -> Any:
    """``bucketize(v1, t) + bucketize(v2, t) + bucketize(v3, t)`` over unbacked sizes (no output size,
    so the fallback decides). ``num_reads()`` counts 6 loads (each lookup reads the table once);
    ``get_reads()`` has 4 dependencies (the table is one StarDep)."""
    import sympy
    from torch._inductor.virtualized import ops

    size = f.unbacked()
    loaders = [f.input(size).make_loader() for _ in range(3)]
    table = f.input(16).get_name()
    boundaries = (table, sympy.Integer(16), sympy.Integer(16), sympy.Integer(1))  # name, size, numel, stride

    def inner_fn(index: Any) -> Any:
        first = ops.index_expr(sympy.Integer(0), torch.int64)
        lookups = [ops.bucketize(load(index), boundaries, first, torch.int64, False) for load in loaders]
        return ops.add(ops.add(lookups[0], lookups[1]), lookups[2])

    return f.ir.Pointwise.create(device=torch.device("cpu"), dtype=torch.int64, inner_fn=inner_fn, ranges=[size])


# name -> (build, users, original's decision, patched decision)
IR_CASES: Dict[str, Tuple[Callable[[_IRFactory], Any], int, bool, bool]] = {
    "2 full reads, 2 users": (lambda f: f.add(f.input(64, 64), f.input(64, 64)), 2, False, False),
    "2 full reads, 3 users (flip: realize)": (lambda f: f.add(f.input(64, 64), f.input(64, 64)), 3, False, True),
    "5 reads, 4 broadcast rows, 2 users (flip: inline)": (
        lambda f: f.add(f.input(64, 64), *(f.input(64) for _ in range(4))), 2, True, False),
    "5 full reads, 2 users": (lambda f: f.add(*(f.input(64, 64) for _ in range(5))), 2, True, True),
    "exp, 2 users (cpu heavy op)": (
        lambda f: f.unary(torch.ops.aten.exp.default, f.add(f.input(64, 64), f.input(64, 64))), 2, True, True),
    "sigmoid, 2 users (cpu heavy op)": (
        lambda f: f.unary(torch.ops.aten.sigmoid.default, f.input(64, 64)), 2, True, True),
    "large inner fn, 2 users": (_long_chain, 2, True, True),
    "exp, 1 user": (lambda f: f.unary(torch.ops.aten.exp.default, f.input(64, 64)), 1, False, False),
    "5 full reads, 1 user": (lambda f: f.add(*(f.input(64, 64) for _ in range(5))), 1, False, False),
    "input buffer (not Pointwise), 5 users": (lambda f: f.input(64, 64), 5, False, False),
    # Unbacked sizes: no byte estimate (get_dep_size_hint -> 0), so the read-count fallback decides.
    "unbacked, 2 reads, 3 users (fallback)": (
        lambda f: (lambda u: f.add(f.input(u, 8), f.input(u, 8)))(f.unbacked()), 3, False, False),
    "unbacked, 5 reads, 2 users (fallback)": (
        lambda f: (lambda u: f.add(*(f.input(u, 8) for _ in range(5))))(f.unbacked()), 2, True, True),
    # Fallback on len(get_reads()) (4: not > 4, inline) where 2.11's num_reads() says 6 (realize).
    "unbacked, 3 bucketize lookups in one table, 2 users (fallback)": (_three_lookups_in_one_table, 2, True, False),
    # An unrealized Reduction: 2.11's get_reads() raises for it, so the original's num_reads() decides.
    "unrealized reduction, 2 users (fallback)": (_sum_rows, 2, False, False),
}


@needs_2_11_rule
@pytest.mark.parametrize("case", list(IR_CASES))
def test_decision_on_constructed_ir(
    case: str, original_and_patched: Tuple[Callable[..., bool], Callable[..., bool]]
) -> None:
    from torch._inductor.virtualized import V

    original, patched = original_and_patched
    build, users, original_decision, patched_decision = IR_CASES[case]
    factory = _IRFactory()
    with V.set_graph_handler(factory.graph):
        box = build(factory).data  # TensorBox -> StorageBox
        assert type(box).__name__ == "StorageBox"
        assert original(box, users) is original_decision
        assert patched(box, users) is patched_decision


@needs_2_11_rule
def test_fallback_counts_dependencies_where_the_original_counts_loads(
    original_and_patched: Tuple[Callable[..., bool], Callable[..., bool]],
) -> None:
    """The case where the card's ``len(self.get_reads())`` and 2.11's ``num_reads()`` differ."""
    from torch._inductor import config as inductor_config
    from torch._inductor.virtualized import V

    original, patched = original_and_patched
    factory = _IRFactory()
    with V.set_graph_handler(factory.graph):
        box = _three_lookups_in_one_table(factory).data
        reads = box.get_reads()
        assert (len(reads), box.num_reads()) == (4, 6)
        assert [type(dep).__name__ for dep in reads].count("StarDep") == 1  # the table, once
        # No output size (unbacked), so the byte rule abstains and the read count decides.
        assert V.graph.sizevars.optimization_hint(box.data.get_numel(), fallback=0) == 0
        assert inductor_config.realize_reads_threshold == 4
        assert original(box, 2) is True  # num_reads() 6 > 4
        assert patched(box, 2) is False  # len(get_reads()) 4, not > 4


# ---- equivalence: compile before/after -------------------------------------------------------

# Recorded on torch 2.11.0+cu130, CPU Inductor (kernels, nests, buffers, bytes); see
# torchpatches._harness.InductorReport for what each counts. ``loads`` depends on the CPU's
# vector ISA (tail loops), so only its direction is asserted.
EXPECTED: Dict[str, Dict[str, Tuple[int, int, int, int]]] = {
    "residual_chain": {"original": (1, 1, 9, 655360), "patched": (1, 2, 10, 786432)},
    "norm_qkv": {"original": (1, 4, 5, 328192), "patched": (1, 4, 5, 328192)},
    "flip_to_realize": {"original": (1, 2, 3, 263680), "patched": (1, 3, 4, 329216)},
    "flip_to_inline": {"original": (1, 2, 3, 199680), "patched": (1, 2, 2, 136192)},
    "cpu_heavy_op": {"original": (1, 3, 3, 328704), "patched": (1, 3, 3, 328704)},
    "flux_tiny": {"original": (18, 84, 45, 619316), "patched": (18, 83, 46, 619060)},
}
# patched loads vs original loads: "<", "=", ">"
LOADS_DIRECTION = {
    "residual_chain": "=", "norm_qkv": "=", "flip_to_realize": "=", "flip_to_inline": ">",
    "cpu_heavy_op": "=", "flux_tiny": "<",
}
# Compiled vs eager: fp32, reductions may be reordered by Inductor.
EAGER_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _flatten(output: Any) -> List[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    return [tensor for item in output for tensor in _flatten(item)]


def _key(measurement: Any) -> Tuple[int, int, int, int]:
    return (measurement.kernels, measurement.nests, measurement.buffers, measurement.bytes)


@needs_2_11_rule
@pytest.mark.slow
@pytest.mark.parametrize("program", list(EXPECTED))
def test_equivalence(program: str, only_this_patch: Path) -> None:
    fn, args = harness.REALIZE_PROGRAMS[program].build(torch.device("cpu"))
    with torch.no_grad():
        eager = fn(*args)
    with torchpatches.only():
        original = harness.inductor_report(fn, *args)
    with torchpatches.only(NAME):
        patched = harness.inductor_report(fn, *args)
    for compiled in (original, patched):
        for got, want in zip(_flatten(compiled.output), _flatten(eager), strict=True):
            torch.testing.assert_close(got, want, **EAGER_TOLERANCE)
    # Realizing or inlining evaluates the same expression in the same fp32 order: bit-identical.
    for got, want in zip(_flatten(patched.output), _flatten(original.output), strict=True):
        assert torch.equal(got, want)
    assert {"original": _key(original), "patched": _key(patched)} == EXPECTED[program]
    direction = "<" if patched.loads < original.loads else ">" if patched.loads > original.loads else "="
    assert direction == LOADS_DIRECTION[program], (original.loads, patched.loads)
    # The patch must change nothing when it does not flip a decision.
    if EXPECTED[program]["original"] == EXPECTED[program]["patched"] and direction == "=":
        assert _strip_ids(patched.code) == _strip_ids(original.code)


def _strip_ids(code: str) -> str:
    """Generated code minus the lines that name the compile (AOT ID, kernel paths)."""
    return "\n".join(line for line in code.splitlines() if "AOT ID" not in line and "/tmp" not in line and "torchinductor" not in line)


# ---- the cache key ---------------------------------------------------------------------------


def _cache_counts() -> Dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
    }


def _cached_compile(fn: Callable[..., Any], args: Tuple[Any, ...]) -> Tuple[int, Dict[str, int], str]:
    """Compile with the FX graph and AOTAutograd caches ON; (buffers, counter deltas, code)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    before = _cache_counts()
    with inductor_config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), \
            functorch_config.patch(enable_autograd_cache=True), torch.no_grad():
        _, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    after = _cache_counts()
    code = "\n".join(codes)
    return harness.count_buffers(code), {k: after[k] - before[k] for k in after}, code


def _served_from_cache(delta: Dict[str, int]) -> bool:
    return delta["fx_hit"] > 0 or delta["aot_hit"] > 0


@needs_2_11_rule
@pytest.mark.slow
def test_cache_key_in_process(tmp_path: Path, only_this_patch: Path) -> None:
    """Unpatched, then patched in the same process: the patched compile is not served the unpatched entry."""
    import torch.compiler.config as compiler_config
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    fn, args = harness.REALIZE_PROGRAMS["flip_to_realize"].build(torch.device("cpu"))
    original_buffers, patched_buffers = EXPECTED["flip_to_realize"]["original"][2], EXPECTED["flip_to_realize"]["patched"][2]
    torchpatches.revert(NAME)
    saved_tag = compiler_config.cache_key_tag  # the user's tag, without our token
    try:
        compiler_config.cache_key_tag = "user-tag"
        with temporary_cache_dir(str(tmp_path)):
            buffers, delta, unpatched_code = _cached_compile(fn, args)
            assert (buffers, _served_from_cache(delta), delta["fx_miss"]) == (original_buffers, False, 1)

            torchpatches.apply(NAME)
            assert compiler_config.cache_key_tag == "user-tag" and TOKEN in _cache_key.key_component()
            buffers, delta, patched_code = _cached_compile(fn, args)
            assert (buffers, _served_from_cache(delta), delta["fx_miss"]) == (patched_buffers, False, 1)

            # Without our token the same patched process IS served the stale unpatched artifact:
            # the hazard the token exists for.
            _cache_key.remove_token(TOKEN)
            try:
                buffers, delta, stale_code = _cached_compile(fn, args)
                assert _served_from_cache(delta) and buffers == original_buffers
                assert _strip_ids(stale_code) == _strip_ids(unpatched_code)
            finally:
                _cache_key.add_token(TOKEN)

            torchpatches.revert(NAME)
            assert compiler_config.cache_key_tag == "user-tag"
            buffers, delta, _ = _cached_compile(fn, args)
            assert _served_from_cache(delta) and buffers == original_buffers

            torchpatches.apply(NAME)
            buffers, delta, code = _cached_compile(fn, args)
            assert _served_from_cache(delta) and buffers == patched_buffers
            assert _strip_ids(code) == _strip_ids(patched_code)
    finally:
        torchpatches.revert(NAME)
        compiler_config.cache_key_tag = saved_tag
        torchpatches.apply(NAME)


_SUBPROCESS_COMPILE = textwrap.dedent(
    """
    import json, sys, torch, torchpatches, torchpatches._core.cache_key
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    sys.path.insert(0, sys.argv[1])
    others = [n for n in torchpatches.patch_names() if n != "inductor_realize"]
    if others:
        torchpatches.revert(others)

    def flip_to_realize(a, b):
        h = a + b
        return h.sum(0), h.sum(1), h.amax(0)

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(128, 128, generator=g), torch.randn(128, 128, generator=g))

    def compile_once():
        torch._dynamo.reset()
        counters.clear()
        with inductor_config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), torch.no_grad():
            _, codes = run_and_get_code(torch.compile(flip_to_realize, fullgraph=True), *args)
        code = "\\n".join(codes)
        return {
            "state": torchpatches.status()["inductor_realize"].state.value,
            "tag": torch.compiler.config.cache_key_tag,
            "key_component": list(torchpatches._core.cache_key.key_component()),
            "buffers": code.count("empty_strided_cpu("),
            "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        }

    runs = [compile_once()]  # torch._inductor.ir is imported by this first compile
    if runs[0]["state"] == "applied":
        torchpatches.revert("inductor_realize")
        runs.append(compile_once())
    print(json.dumps(runs))
    """
)


def _compile_in_subprocess(cache_dir: Path, disable: str) -> List[Dict[str, Any]]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TORCH_COMPILE_CACHE_KEY_TAG="user-tag",
               TORCHPATCHES_DISABLE=disable)
    result = subprocess.run([sys.executable, "-c", _SUBPROCESS_COMPILE, str(REPO)], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@needs_2_11_rule
@pytest.mark.slow
def test_cache_key_across_processes(tmp_path: Path, only_this_patch: Path) -> None:
    """This process, unpatched, fills the cache; a second, patched process must miss, then hit after revert.

    The unpatched entry is written here rather than in a third process: every fresh process
    spends ~30-40 s (2 cores) in Inductor's CPU vector-ISA probe, which compiles and loads a test
    library per ISA in subprocesses.
    """
    import torch.compiler.config as compiler_config
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    original_buffers, patched_buffers = EXPECTED["flip_to_realize"]["original"][2], EXPECTED["flip_to_realize"]["patched"][2]
    fn, args = harness.REALIZE_PROGRAMS["flip_to_realize"].build(torch.device("cpu"))
    torchpatches.revert(NAME)
    saved_tag = compiler_config.cache_key_tag
    try:
        compiler_config.cache_key_tag = "user-tag"  # what TORCH_COMPILE_CACHE_KEY_TAG gives the child
        with temporary_cache_dir(str(tmp_path)):
            buffers, delta, _ = _cached_compile(fn, args)
        assert (buffers, delta["fx_miss"]) == (original_buffers, 1)
    finally:
        compiler_config.cache_key_tag = saved_tag
        torchpatches.apply(NAME)

    patched, reverted = _compile_in_subprocess(tmp_path, disable="")
    # The token is in the key component computed at lookup the child's first compile computed it (the patch applied
    # when that compile imported torch._inductor.ir), so the child compiled its own artifact.
    assert patched["state"] == "applied" and patched["tag"] == "user-tag" and patched["key_component"] == [TOKEN]
    assert (patched["buffers"], patched["fx_miss"], patched["fx_hit"], patched["aot_hit"]) == (patched_buffers, 1, 0, 0)
    # After revert the tag is the user's again and this process's unpatched artifact is served.
    assert reverted["state"] == "disabled" and reverted["key_component"] == []
    assert reverted["buffers"] == original_buffers and (reverted["fx_hit"] or reverted["aot_hit"])


# ---- any other original (2.13, 2.14, 2.15, ...): skipped by fingerprint, nothing changes ---------------


@needs_other_rule
def test_skipped_by_fingerprint_with_a_reason() -> None:
    import torch._inductor.ir as ir
    import torch.compiler.config as compiler_config

    status = torchpatches.status()[NAME]
    assert status.state.value == "skipped"
    # The version gate admits every torch >= 2.11: the reason is the fingerprint, not the version.
    assert f"fingerprint {ORIGINAL_FINGERPRINT}" in status.reason and FINGERPRINT_TORCH_2_11_0 in status.reason
    assert "outside" not in status.reason, status.reason
    original = ir.StorageBox.should_realize_on_reuse
    assert original.__module__ == "torch._inductor.ir"
    assert fingerprint(original) == ORIGINAL_FINGERPRINT not in PATCH.targets[0].fingerprints
    assert "torchpatches" not in compiler_config.cache_key_tag
    torchpatches.apply(NAME)  # asking explicitly changes nothing either
    assert torchpatches.status()[NAME].state.value == "skipped"
    assert ir.StorageBox.should_realize_on_reuse is original


@needs_other_rule
@pytest.mark.slow
def test_compiled_output_unchanged_where_skipped(only_this_patch: Path) -> None:
    import torch._inductor.ir as ir

    original = ir.StorageBox.should_realize_on_reuse
    fn, args = harness.REALIZE_PROGRAMS["flip_to_realize"].build(torch.device("cpu"))
    with_torchpatches = harness.inductor_report(fn, *args)
    torchpatches.revert(NAME)
    try:
        assert ir.StorageBox.should_realize_on_reuse is original
        without = harness.inductor_report(fn, *args)
    finally:
        torchpatches.apply(NAME)
    assert _strip_ids(with_torchpatches.code) == _strip_ids(without.code)
    for got, want in zip(_flatten(with_torchpatches.output), _flatten(without.output), strict=True):
        assert torch.equal(got, want)
