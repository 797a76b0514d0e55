"""Version gates and fingerprints: how a patch proves its target is what it was written against."""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect
import sys
import textwrap
from typing import TYPE_CHECKING, Any, List, Mapping, Optional

if TYPE_CHECKING:
    from packaging.version import Version

# packaging is imported inside the functions that need it: its regexes cost ~20 ms to compile,
# and importing torchpatches must stay cheap (versions are only read once a target loads).

__all__ = ["fingerprint", "installed_version", "is_installed", "release_version", "check_requirements"]

#: Distribution names of importable packages whose names differ from the module's.
DISTRIBUTIONS = {"flashinfer": "flashinfer-python"}


def fingerprint(obj: Any) -> str:
    """A short, Python-version-independent hash of ``obj``'s source code.

    Source rather than bytecode: bytecode changes between CPython minor versions while the
    code we reviewed does not. A decorated function (``functools.wraps``) is hashed with every
    layer it wraps, so a change to the decorator's wrapper is caught as well as a change to the
    function (``inspect.getsource`` alone would follow ``__wrapped__`` and hash only the innermost).
    Raises ``OSError``/``TypeError`` when no layer has source.
    """
    sources = [source for source in map(_own_source, _wrapped_chain(obj)) if source is not None]
    if not sources:
        raise TypeError(f"no source code for {obj!r}")
    return hashlib.sha256("\n".join(sources).encode("utf-8")).hexdigest()[:16]


def _wrapped_chain(obj: Any) -> List[Any]:
    chain: List[Any] = []
    while obj is not None and all(obj is not seen for seen in chain):
        chain.append(obj)
        obj = getattr(obj, "__wrapped__", None)
    return chain


def _own_source(obj: Any) -> Optional[str]:
    """The source of ``obj`` itself, not of what it wraps; None for objects without source (C wrappers)."""
    obj = getattr(obj, "__func__", obj)  # classmethod / staticmethod / bound method
    target = getattr(obj, "__code__", obj)
    try:
        return textwrap.dedent(inspect.getsource(target))
    except (OSError, TypeError):
        return None


def installed_version(module: str) -> Optional[str]:
    """The version of the package that provides top-level ``module``; None if not installed.

    An imported module's ``__version__`` is read first (cheap, and right for source builds
    whose metadata lags); otherwise the distribution metadata, which never imports it.
    """
    loaded = sys.modules.get(module)
    version = getattr(loaded, "__version__", None)
    if isinstance(version, str):
        return str(version)
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(module, module))
    except importlib.metadata.PackageNotFoundError:
        return None


def is_installed(module: str) -> bool:
    """Whether top-level ``module`` can be imported, without importing it (a few stat calls)."""
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def release_version(version: str) -> "Version":
    """The release a build belongs to, for gating.

    ``2.11.0+cu130`` (local build tag) and ``2.11.0a0+git6ddfef5`` (NVIDIA / source dev build)
    both gate as 2.11.0: such builds are judged by the release number they carry, and the
    fingerprint of each target decides whether the code really is what the patch expects.
    """
    from packaging.version import Version

    parsed = Version(version)
    return Version(".".join(str(part) for part in parsed.release))


def check_requirements(requires: Mapping[str, str]) -> Optional[str]:
    """None if every package satisfies its specifier, else a sentence saying which does not.

    ``requires`` maps top-level module names (``torch``, ``diffusers``) to specifiers.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion

    for distribution, spec_text in requires.items():
        try:
            spec = SpecifierSet(spec_text)
        except InvalidSpecifier as error:
            return f"invalid version specifier {spec_text!r} for {distribution}: {error}"
        found = installed_version(distribution)
        if found is None:
            return f"{distribution} is not installed (needs {distribution}{spec_text})"
        try:
            release = release_version(found)
        except InvalidVersion:
            return f"{distribution} {found} has a version this patch cannot read (needs {distribution}{spec_text})"
        if release not in spec:
            return f"{distribution} {found} is outside {distribution}{spec_text}"
    return None
