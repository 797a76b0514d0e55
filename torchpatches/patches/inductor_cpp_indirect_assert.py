"""inductor_cpp_indirect_assert: Inductor's CPU C++ code compiles where a vectorized gather is bounds-checked under
a scalar mask (torch 2.11).

What goes wrong upstream
    ``torch.compile(lambda t, idx: F.pad(t[idx], (0, 0, 1, 0)))`` with a 1-D ``t`` and a 2-D ``idx`` fails on the
    CPU with ``CppCompileError``: the gathered index varies along the vectorized dimension while the padding's mask
    depends only on the outer one, and ``CppVecKernel.indirect_assert`` wraps that scalar mask as
    ``VecMask<int64_t, N>(tmp)``, a constructor that does not exist (``no matching function for call to
    VecMask<long int, 2>::VecMask(bool&)``). pytorch/pytorch#178148 (in 2.12) writes ``VecMask<...>::from(tmp)``;
    vLLM's ``env_override.py`` carries the same change for 2.11.

What the patch changes
    Where the index is a vector and the mask a scalar, the original receives the mask already broadcast
    (``VecMask<...>::from(mask)``, marked as a vector), so it emits 2.12's expression; every other call is the
    original's. The generated code changes where the original's does not compile, so the patch enters Inductor's
    cache key.

Versions
    torch 2.11.0 (fingerprint ``161b5531109588da``); 2.12.1, 2.13.0 and 2.15.0 carry the fix (read; skipped by
    fingerprint).

When to delete
    When the supported torch floor is 2.12.
"""
from .._core.declare import Patch, Target

_BODY = "torchpatches.patches._bodies.inductor_cpp_indirect_assert"
#: fingerprint(torch._inductor.codegen.cpp.CppVecKernel.indirect_assert) of torch 2.11.0.
FINGERPRINT_TORCH_2_11_0 = "161b5531109588da"


PATCH = Patch("inductor_cpp_indirect_assert", targets=Target(
    "torch._inductor.codegen.cpp:CppVecKernel.indirect_assert", f"{_BODY}:make_replacement",
    {FINGERPRINT_TORCH_2_11_0}),
    summary="torch 2.11 Inductor CPU: a vectorized gather bounds-checked under a scalar mask compiles (pytorch#178148)",
    requires={"torch": ">=2.11"}, inductor_cache_key=True)
