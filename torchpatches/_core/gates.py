"""Version gates and fingerprints: how a patch proves its target is what it was written against.

Needed once a target's module has loaded, so it is imported then, not by ``import torchpatches``
(whether a required package is installed at all is :func:`torchpatches._core.import_hooks.not_installed_reason`).
"""
from __future__ import annotations

import __future__
import hashlib
import importlib.metadata
import inspect
import os
import sys
import textwrap
import types
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

if TYPE_CHECKING:
    from packaging.version import Version

# packaging is imported inside the functions that need it: its regexes cost ~20 ms to compile,
# and importing torchpatches must stay cheap (versions are only read once a target loads).

__all__ = ["fingerprint", "future_flags", "SourceMismatch", "installed_version", "release_version",
           "check_requirements"]

#: Distribution names of importable packages whose names differ from the module's.
DISTRIBUTIONS = {"flashinfer": "flashinfer-python"}


class SourceMismatch(TypeError):
    """The source file no longer describes the running code (edited after import, or a copy compiled
    from that file with other code, such as a replacement): the object cannot be fingerprinted."""


def fingerprint(obj: Any) -> str:
    """A short, Python-version-independent hash of ``obj``'s source code, *as it runs*.

    Source rather than bytecode: bytecode changes between CPython minor versions while the
    code we reviewed does not. A decorated function (``functools.wraps``) is hashed with every
    layer it wraps, so a change to the decorator's wrapper is caught as well as a change to the
    function (``inspect.getsource`` alone would follow ``__wrapped__`` and hash only the innermost).

    ``inspect`` reads the source from the file on disk at the code's filename and line, which need
    not be what runs: the file may have been edited after import, and a copy compiled from the same
    file and lines with other code (``compile_warnings``' replacements are) would read exactly like
    the original. So for every layer with a code object, the source read is compiled again and must
    give the running bytecode; otherwise :class:`SourceMismatch` is raised.
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


# Sources verified against their running code, by code object: {id(code): (ref to code, file stamp, source)}.
# Verifying compiles the source again (~3 ms a function), and ``disabled()`` / ``apply()`` re-verify every
# target on each switch; a code object never changes, so its verified source stays true while its file is
# unchanged on disk (a file edited since is read and verified again, and fails as it did before the cache).
_VERIFIED: Dict[int, Tuple["weakref.ref[types.CodeType]", Tuple[int, int], Optional[str]]] = {}


def _own_source(obj: Any) -> Optional[str]:
    """The source of ``obj`` itself, not of what it wraps; None for objects without source (C wrappers).

    Raises :class:`SourceMismatch` when the source found does not compile to the running code.
    """
    obj = getattr(obj, "__func__", obj)  # classmethod / staticmethod / bound method
    code = getattr(obj, "__code__", None)
    if not isinstance(code, types.CodeType):
        return _read_own_source(obj, None)
    stamp = _file_stamp(code.co_filename)
    known = _VERIFIED.get(id(code))
    if stamp is not None and known is not None and known[0]() is code and known[1] == stamp:
        return known[2]
    source = _read_own_source(obj, code)
    if stamp is not None:
        key = id(code)
        _VERIFIED[key] = (weakref.ref(code, lambda _ref, key=key: _VERIFIED.pop(key, None)), stamp, source)
    return source


def _file_stamp(filename: str) -> Optional[Tuple[int, int]]:
    try:
        status = os.stat(filename)
    except (OSError, ValueError):
        return None
    return status.st_mtime_ns, status.st_size


def _read_own_source(obj: Any, code: Optional[types.CodeType]) -> Optional[str]:
    target = code if code is not None else obj
    try:
        raw = inspect.getsource(target)
    except (OSError, TypeError):
        return None
    except Exception as error:  # noqa: BLE001 - a file edited into something tokenize rejects (TokenError...)
        raise SourceMismatch(f"the source of {getattr(obj, '__qualname__', obj)!r} cannot be read: "
                             f"{type(error).__name__}: {error}") from None
    source = textwrap.dedent(raw)
    if code is not None and not _compiles_to(raw, code, getattr(obj, "__globals__", {})):
        raise SourceMismatch(
            f"the source of {getattr(obj, '__qualname__', obj)!r} in {code.co_filename} (line {code.co_firstlineno}) "
            "is not the code that runs: the file was edited after import, or this object was compiled from "
            "other source (a replacement)"
        )
    return source


def _compiles_to(raw_source: str, code: types.CodeType, globals_: Mapping[str, Any]) -> bool:
    """Whether ``raw_source`` (one def as inspect found it, indentation kept) compiles to ``code``.

    The def is compiled where it was defined: inside classes named as in its ``__qualname__`` (name
    mangling, the ``__class__`` cell of zero-argument ``super()``) and inside a function that owns
    its free variables (closures), at its own indentation (docstrings keep their text), with the
    module's ``from __future__`` flags and the interpreter's optimization level (``-O``/``-OO``),
    as the import that made ``code`` did.
    """
    first = raw_source.lstrip("\n").splitlines()[0] if raw_source.strip() else ""
    indent = len(first) - len(first.lstrip(" \t"))
    scopes = code.co_qualname.split(".")[:-1] if hasattr(code, "co_qualname") else []
    classes: List[str] = []
    for part in reversed(scopes):
        if part == "<locals>":
            break
        classes.insert(0, part)
    free = [name for name in code.co_freevars if name != "__class__"]
    headers: List[str] = []
    if free:
        headers.append("def _torchpatches_outer():")
    headers += [f"class {name}:" for name in classes]
    if len(headers) > indent:
        return False  # cannot nest it at its own indentation: unverifiable, so not patched
    lines = []
    for level, header in enumerate(headers):
        lines.append(" " * level + header)
        if level == 0 and free:  # at the indentation of the statement that follows it in that body
            lines.append(" " * (1 if classes else indent) + " = ".join(free) + " = None")
    lines.append(raw_source if headers else textwrap.dedent(raw_source))
    try:
        compiled = compile("\n".join(lines), code.co_filename, "exec", flags=future_flags(globals_),
                           dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return any(_same_code(candidate, code) for candidate in _code_objects(compiled) if candidate.co_name == code.co_name)


def future_flags(globals_: Mapping[str, Any]) -> int:
    """The compiler flags of the ``from __future__`` imports in a module's globals (to compile its code again)."""
    flags = 0
    for feature_name in __future__.all_feature_names:
        feature = getattr(__future__, feature_name)
        if globals_.get(feature_name) is feature:
            flags |= feature.compiler_flag
    return flags


def _code_objects(code: types.CodeType) -> List[types.CodeType]:
    found = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found.extend(_code_objects(const))
    return found


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    """Same names, variables, constants and instruction stream (see :func:`_instructions`)."""
    if (a.co_names, a.co_varnames, a.co_freevars, a.co_cellvars, a.co_argcount, a.co_kwonlyargcount,
            a.co_posonlyargcount) != (b.co_names, b.co_varnames, b.co_freevars, b.co_cellvars, b.co_argcount,
                                      b.co_kwonlyargcount, b.co_posonlyargcount):
        return False
    if len(a.co_consts) != len(b.co_consts):
        return False
    for x, y in zip(a.co_consts, b.co_consts):
        if isinstance(x, types.CodeType) and isinstance(y, types.CodeType):
            if not _same_code(x, y):
                return False
        elif type(x) is not type(y) or (x != y and not (x != x and y != y)):  # nan == nan here
            return False
    return _instructions(a) == _instructions(b)


# Bytecode that differs between patch releases of one CPython minor version, for the same source
# (a .pyc written by 3.11.x is loaded by 3.11.y): 3.11.4+ emits LOAD_ATTR where earlier releases
# emitted LOAD_METHOD, with or without PUSH_NULL/PRECALL around calls. Jump targets move with them.
_EQUIVALENT_OPS = {"LOAD_METHOD": "LOAD_ATTR"}
_IGNORED_OPS = frozenset({"NOP", "CACHE", "PRECALL", "PUSH_NULL", "EXTENDED_ARG", "RESUME", "KW_NAMES"})


def _instructions(code: types.CodeType) -> List[Any]:
    """The instruction stream, normalized: opcodes with their operands as names/values (not
    offsets), jump targets dropped, release-to-release differences folded away."""
    import dis

    stream: List[Any] = []
    for instruction in dis.get_instructions(code):
        name = _EQUIVALENT_OPS.get(instruction.opname, instruction.opname)
        if name in _IGNORED_OPS:
            continue
        if instruction.opcode in dis.hasjrel or instruction.opcode in dis.hasjabs:
            stream.append(name)
            continue
        argument = instruction.argrepr
        if name in ("LOAD_ATTR", "LOAD_GLOBAL"):  # 3.12 prints "NULL|self + name" for method loads
            argument = argument.rsplit(" + ", 1)[-1]
        if isinstance(instruction.argval, types.CodeType):
            argument = instruction.argval.co_name
        stream.append((name, argument))
    return stream


def installed_version(module: str) -> Optional[str]:
    """The version of the package that provides top-level ``module``; None if not installed.

    An imported module's ``__version__`` is read first (cheap, and right for source builds
    whose metadata lags); otherwise the distribution metadata, which never imports it.
    """
    loaded = sys.modules.get(module)
    try:
        version = getattr(loaded, "__version__", None)
    except Exception:  # a stub or lazy module whose __getattr__ raises: read the metadata instead
        version = None
    if isinstance(version, str):
        return str(version)
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(module, module))
    except importlib.metadata.PackageNotFoundError:
        return None


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
        try:
            found = installed_version(distribution)
        except Exception as error:  # noqa: BLE001 - broken metadata must give a reason, not an exception
            return f"cannot read the version of {distribution} ({type(error).__name__}: {error})"
        if found is None:
            return f"{distribution} is not installed (needs {distribution}{spec_text})"
        try:
            release = release_version(found)
        except InvalidVersion:
            return f"{distribution} {found} has a version this patch cannot read (needs {distribution}{spec_text})"
        if release not in spec:
            return f"{distribution} {found} is outside {distribution}{spec_text}"
    return None
