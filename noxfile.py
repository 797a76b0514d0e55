"""The test matrix: one nox session per torch release, each in its own virtual environment.

    tools/nox                                   # every default session (CI runs exactly this)
    tools/nox -s tests-2.13.0 -- -k rope        # one torch; arguments after -- go to pytest
    tools/nox -R -s tests-2.13.0 -- -k rope     # the same, reusing the environment without reinstalling
    tools/nox -l                                # list the sessions

``tools/nox`` installs nox (``requirements/nox.txt``) into ``.venvs/nox`` on first use and runs it;
with nox already installed, plain ``nox`` does the same. Environments live in ``.nox/`` and are
reused between runs (pip then only checks them); ``--reuse-venv=no`` rebuilds them.

Sessions select tests by marker and path (``MATRIX``; markers in setup.cfg): the full suite under the newest
torch release, the fast set (``-m "not slow"``) and inductor_realize's tests under 2.11.0, the fast set and the
``once`` tests under 2.13.0, under 2.12.1 what it is in the matrix for (inductor_realize, the Inductor cache
key), the diffusers patches' per-release tests under older diffusers; every run on
pytest-xdist. Each prints its pytest time.

Each session installs ``requirements/torch-<version>.txt`` together with ``-e .[test]`` in one pip
resolve, so every torch brings the triton it declares; only what must be pinned is pinned there and
in ``requirements/constraints.txt``. pip's output is shown when it fails (with the resolver's reason).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Dict, List, Sequence

import nox

ROOT = Path(__file__).resolve().parent
REQUIREMENTS = ROOT / "requirements"

#: What a session's pytest selects (markers: setup.cfg). Every test runs somewhere in the matrix.
FULL = "not once"  # the whole suite but what one session runs for all (the newest release)
FAST = "not slow"  # what runs in seconds; a release's own tests are added by marker

#: torch release -> (why it is in the matrix, pytest's -m selection, the test paths: all when empty). The default
#: sessions are what CI runs.
MATRIX = {
    # The oldest release: the fast set and inductor_realize's tests (slow ones included); the rest of the slow set
    # runs on the newest release only (for CI's time budget).
    "2.11.0": ("the release inductor_realize was written for (CUDA build, runs on the CPU)",
               f"({FAST} and not once) or inductor_realize", ()),
    # The release besides 2.11 where inductor_realize applies; unlike 2.11 it keeps config overrides per thread
    # (ContextVar), so an applied Inductor patch meets that config model only here; inductor_fallback_log applies here
    # too. Between two releases that run the whole fast set (2.11, 2.13), it runs what it is here for:
    # inductor_realize and the Inductor cache key (for CI's time budget). The kernels' tests (tests/ops) do not run
    # here: the triton it brings (3.7.1) is the one the 2.13.0 session pins, which runs them.
    "2.12.1": ("the other release with 2.11's realize rule (CUDA build, runs on the CPU)",
               f"({FAST} and not once) or inductor_realize",
               ("tests/patches/test_inductor_realize.py", "tests/test_cache_key.py", "tests/test_cache_key_hostile.py",
                "tests/patches/test_inductor_fallback_log.py")),
    # -OO recompiles torch's and diffusers' bytecode (half a minute): once, here, where torch is a local wheel.
    "2.13.0": ("a release whose Inductor rule differs (inductor_realize skipped); CPU wheel", f"{FAST} or once", ()),
    "2.15.0": ("the newest release (CUDA build from PyPI, runs on the CPU)", FULL, ()),
}
#: Sessions that exist but are not run by default (none today; e.g. a release being evaluated): as MATRIX.
EXTRA: dict = {}

#: pytest-xdist's arguments: one worker per core, tests handed out one by one and stolen by an idle worker
#: (``worksteal``). A file's tests may run in both workers, each in collection order with its own module
#: fixtures; no test may depend on another's side effects. Against ``loadfile`` (a file per worker) the torch 2.15.0
#: suite took 540 s instead of 628 s on 2 cores (same 1140 passed), and the diffusers sessions no longer wait on
#: test_compile_warnings.py alone.
XDIST = ["-n", "auto", "--dist", "worksteal"]

#: diffusers releases tested besides 0.42.1 (which every tests-<torch> session runs), under torch 2.13.0:
#: release -> (why, pytest runs: each a list of arguments). Only what differs by diffusers release runs
#: there: the patches' fingerprints and sources, the graph-break sites they fix (slow cases included:
#: marker by_diffusers), the doctor on a diffusers model. Older releases install over the [test] extra's pin.
_PER_RELEASE = [
    ["tests/patches/test_rope_patch.py", "tests/patches/test_compile_warnings.py", "tests/patches/test_cp_all_to_all.py",
     "tests/patches/test_cp_ring_attention.py", "tests/patches/test_cp_ulysses_anything.py",
     "tests/patches/test_qwenimage_text_seq_len.py", "-m", f"{FAST} or by_diffusers", *XDIST],
    ["tests/test_doctor.py", "-k", "flux", "-m", FAST, *XDIST],
]
DIFFUSERS = {
    "0.35.2": (
        "the oldest source rope accepts (fingerprint d9b2553000168b6b); FLUX.2 arrived in 0.36",
        [["tests/patches/test_rope_patch.py", "-k", "not flux2", "-m", FAST, *XDIST]],
    ),
    "0.40.0": ("the oldest release compile_warnings accepts", _PER_RELEASE),
    "0.41.0": ("the newest release before 0.42", _PER_RELEASE),
}

nox.needs_version = ">=2024.10.9"  # --reuse-venv / nox.options.reuse_venv
nox.options.reuse_venv = "yes"
# uv installs a session's environment about 3x faster than pip here (torch 2.13.0's: 17 s against 51 s, no
# caches, the same packages); where uv is not installed, virtualenv and pip.
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = [
    "packaging", *(f"tests-{version}" for version in MATRIX), *(f"diffusers-{version}" for version in DIFFUSERS),
    "peft-accelerate",
]


def _pip_env() -> dict:
    """The installers' environment inside a session: our constraint file replaces one from pip's configuration.

    An environment variable outranks pip's configuration files, so a machine-wide constraint (this
    project's CI machine caps torch at 2.14.1 in /etc/xdg/pip) cannot stop the 2.15.0 session. A
    PIP_CONSTRAINT the user set themselves is kept, next to ours. uv reads no pip configuration, so it is
    given pip's find-links and indexes (where the torch 2.13.0 CPU wheel lies), pip's choice of the best
    version across indexes and pip's bytecode compilation; a UV_* variable the user set wins.
    """
    ours = str(REQUIREMENTS / "constraints.txt")
    theirs = os.environ.get("PIP_CONSTRAINT", "").strip()
    env = {"PIP_CONSTRAINT": f"{theirs} {ours}".strip(), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "UV_CONSTRAINT": f"{os.environ.get('UV_CONSTRAINT', '')} {ours}".strip(),
           # The .pyc files pip writes at install and uv does not by default. Without them, where
           # PYTHONDONTWRITEBYTECODE is set (as on this project's CI machine), every Python a test starts
           # compiles torch and diffusers from source: 21 s instead of 8 s to import them.
           "UV_COMPILE_BYTECODE": os.environ.get("UV_COMPILE_BYTECODE", "1")}
    pip = _pip_settings()
    for uv_name, pip_name, separator in (("UV_FIND_LINKS", "find-links", ","), ("UV_INDEX_URL", "index-url", " "),
                                         ("UV_EXTRA_INDEX_URL", "extra-index-url", " ")):
        if pip.get(pip_name) and uv_name not in os.environ:
            env[uv_name] = separator.join(pip[pip_name].split())
    env.setdefault("UV_INDEX_STRATEGY", os.environ.get("UV_INDEX_STRATEGY", "unsafe-best-match"))
    return env


@functools.lru_cache(maxsize=None)
def _pip_settings() -> Dict[str, str]:
    """pip's effective settings (configuration files, then PIP_* variables, which outrank them): name -> value."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    files, variables = {}, {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        (variables if key.startswith(":env:") else files)[key.rsplit(".", 1)[-1]] = value.strip().strip("'\"")
    return {**files, **variables}


def _pytest(session: nox.Session, *args: str) -> None:
    """pytest with the session's arguments; its time is in CI's log (nox prints none per session)."""
    started = time.monotonic()
    try:
        session.run("python", "-m", "pytest", *args, *session.posargs)
    finally:
        session.log(f"pytest {' '.join(args)}: {time.monotonic() - started:.0f} s")


def _tests(session: nox.Session, version: str, selection: str, paths: Sequence[str]) -> None:
    requirements = REQUIREMENTS / f"torch-{version}.txt"
    session.install("-r", str(requirements), "-e", ".[test]", env=_pip_env())
    session.run(
        "python", "-c",
        "import sys, torch, torchpatches, triton; "
        "print(f'torch {torch.__version__}, triton {triton.__version__}, Python {sys.version.split()[0]}, '"
        "f'torchpatches from {torchpatches.__file__}')",
    )
    # One worker per core: the suite is CPU-bound Python (Dynamo, Inductor's lowering): on 2 cores the torch
    # 2.15.0 suite took 393 s instead of 665 s (same 771 passed, 61 skipped).
    # --durations: the slowest tests in every CI log, for the time budget (docs/development.md)
    _pytest(session, *paths, "-m", selection, *XDIST, "--durations=15")


def _register(version: str, why: str, selection: str, paths: Sequence[str], default: bool) -> None:
    def tests(session: nox.Session) -> None:
        _tests(session, version, selection, paths)

    tests.__doc__ = f"pytest {' '.join(paths)}{' ' if paths else ''}-m '{selection}' under torch {version}: {why}"
    nox.session(name=f"tests-{version}", tags=["tests"] if default else ["extra"])(tests)


for _version, (_why, _selection, _paths) in MATRIX.items():
    _register(_version, _why, _selection, _paths, default=True)
for _version, (_why, _selection, _paths) in EXTRA.items():
    _register(_version, _why, _selection, _paths, default=False)


def _register_diffusers(version: str, why: str, pytest_runs: list) -> None:
    def diffusers(session: nox.Session) -> None:
        # No [test] extra (it pins diffusers 0.42.1): its test tools, and this diffusers release.
        session.install("-r", str(REQUIREMENTS / "torch-2.13.0.txt"), "-e", ".", "pytest>=7", "pytest-xdist>=3.5",
                        "hypothesis>=6.80", f"diffusers=={version}", env=_pip_env())
        session.run("python", "-c", "import diffusers, torch; print(f'diffusers {diffusers.__version__}, torch {torch.__version__}')")
        for args in pytest_runs:
            _pytest(session, *args)

    diffusers.__doc__ = f"the diffusers patches' tests under diffusers {version}, torch 2.13.0: {why}"
    nox.session(name=f"diffusers-{version}", tags=["diffusers"])(diffusers)


for _version, (_why, _args) in DIFFUSERS.items():
    _register_diffusers(_version, _why, _args)


@nox.session(name="peft-accelerate", tags=["extras"])
def peft_accelerate(session: nox.Session) -> None:
    """The fusion patches with a LoRA-loaded (peft) model and accelerate hooks, and the ``lora`` pattern, under
    torch 2.13.0.

    A session of its own: the [test] extra leaves peft out, because compile_warnings' "no PEFT
    backend" cases need peft absent, so in the tests-<torch> sessions these cases skip.
    """
    session.install("-r", str(REQUIREMENTS / "torch-2.13.0.txt"), "-r", str(REQUIREMENTS / "peft-accelerate.txt"),
                    "-e", ".[test]", env=_pip_env())
    session.run("python", "-c", "import peft, accelerate, accelerate.hooks, torch; "
                "print(f'peft {peft.__version__}, accelerate {accelerate.__version__}, torch {torch.__version__}')")
    # One run (-k also matches the module's name, so test_lora*.py run whole):
    # - every model's LoRA case (FLUX.1, and SD3 / Wan / QwenImage parametrized) and the accelerate hooks;
    # - the lora pattern (peft's LoRA layers); lora_scale's cases with peft (its walk runs in every session);
    # - the adapter invalidations of the remembered verdicts and the CUDA graphs (they skip where peft is absent,
    #   as in the tests-<torch> sessions); QwenImage's accelerate-hook case; a FluxPipeline through the CUDA-graph
    #   wrapper (it needs transformers, which peft brings).
    _pytest(session, "tests/patches/test_fused_patches.py", "tests/patches/test_lora.py",
            "tests/patches/test_lora_scale.py", "tests/patches/test_fused_verdicts.py", "tests/test_cuda_graphs.py",
            "tests/patches/test_fused_qwenimage.py", "-k", "lora or accelerate or peft or pipeline", "-rs", *XDIST)


#: What the wheel of a release may hold: the package and its metadata, nothing else (no tests, benchmarks, results).
PACKAGE = "torchpatches"


def _members(archive: Path) -> List[str]:
    """The files of a wheel, or of an sdist without its top folder (``torchpatches-<version>/``)."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as wheel:
            return [name for name in wheel.namelist() if not name.endswith("/")]
    with tarfile.open(archive) as sdist:
        return [member.name.split("/", 1)[1] for member in sdist.getmembers() if member.isfile()]


def _check_contents(session: nox.Session, sdist: Path, wheel: Path) -> None:
    """The wheel holds the package and its dist-info only; the sdist the package, the whole test suite (MANIFEST.in)
    and no benchmarks or their results; neither holds bytecode."""
    version = wheel.name.split("-")[1]
    wheel_files, sdist_files = _members(wheel), _members(sdist)
    stray = [name for name in wheel_files
             if not name.startswith((f"{PACKAGE}/", f"{PACKAGE}-{version}.dist-info/"))]
    assert not stray, f"the wheel holds files outside the package and its metadata: {stray}"
    package = sorted(name for name in wheel_files if name.startswith(f"{PACKAGE}/"))
    assert f"{PACKAGE}/__main__.py" in package, package
    assert sorted(name for name in sdist_files if name.startswith(f"{PACKAGE}/")) == package, \
        "the sdist's package files differ from the wheel's"
    shipped = [name for name in sdist_files if name.startswith("benchmarks/") or "/results/" in f"/{name}"]
    assert not shipped, f"the sdist holds benchmarks or their results: {shipped}"
    assert "tests/conftest.py" in sdist_files, "the sdist lacks the test suite's conftest.py (MANIFEST.in)"
    bytecode = [name for name in wheel_files + sdist_files if name.endswith((".pyc", ".pyo"))]
    assert not bytecode, f"bytecode in the release artefacts: {bytecode}"
    tests = sum(name.startswith("tests/") for name in sdist_files)
    session.log(f"packaging: {wheel.name}: {len(wheel_files)} files ({len(package)} in {PACKAGE}/, "
                f"{len(wheel_files) - len(package)} in its dist-info); {sdist.name}: {len(sdist_files)} files "
                f"({len(package)} in {PACKAGE}/, {tests} in tests/, {len(sdist_files) - len(package) - tests} others)")


@nox.session
def packaging(session: nox.Session) -> None:
    """The release artefacts, and pip installs through PEP 517 in fresh environments.

    - ``python -m build`` makes the sdist and, from it, the wheel; ``twine check --strict`` accepts both
      (``requirements/packaging.txt``);
    - the wheel holds only the package and its dist-info; the sdist the package, the tests and what they read
      (MANIFEST.in), no benchmarks or results;
    - the wheel installs into a fresh environment with its dependencies (torch from
      ``requirements/torch-2.13.0.txt``: the CPU wheel where pip's find-links has it, as in tests-2.13.0), and
      ``python -m torchpatches`` exits 0 there;
    - pip installs the checkout (editable and not, with and without build isolation) into fresh ``python -m venv``
      environments without dependencies (``--no-deps``: these check the build, not torch). Without build
      isolation pip uses the environment's own setuptools, which must be >= 70.1 (pyproject.toml); ``wheel`` is
      not needed and is checked to be absent.
    """
    started = time.monotonic()
    env = _pip_env()
    uv = session.venv_backend == "uv"
    session.install("-r", str(REQUIREMENTS / "packaging.txt"), env=env)
    # Metadata and location only: importing torchpatches imports torch, which the --no-deps environments lack.
    check = (
        "import importlib.metadata as m, importlib.util as u, sys; "
        "spec = u.find_spec('torchpatches'); "
        "print(m.version('torchpatches'), spec.origin); "
        "assert u.find_spec('wheel') is None, 'wheel is installed'; "
        "assert (sys.argv[1] in spec.origin) == (sys.argv[2] == 'editable'), spec.origin"
    )
    with tempfile.TemporaryDirectory(prefix="torchpatches-packaging-") as tmp:
        session.log("packaging: sdist and wheel (python -m build), twine check")
        dist = Path(tmp) / "dist"
        # build's isolated environments made by the session's uv: 1.6 s for both builds instead of 8 s with pip.
        installer = ["--installer", "uv"] if uv else []
        session.run("python", "-m", "build", *installer, "--outdir", str(dist), str(ROOT), silent=True,
                    env={**env, "UV": nox.virtualenv.UV} if uv else env)
        (sdist,), (wheel,) = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
        session.run("python", "-m", "twine", "check", "--strict", str(sdist), str(wheel))
        _check_contents(session, sdist, wheel)

        session.log("packaging: the wheel with its dependencies, python -m torchpatches")
        venv = Path(tmp) / "venv-wheel-with-dependencies"
        python = str(venv / "bin" / "python")
        torch = str(REQUIREMENTS / "torch-2.13.0.txt")  # a constraint: the wheel's own requirements bring torch
        # No bytecode compiled at install: all of torch's costs about 6 s, importing it once from source about 1 s.
        deps_env = {**env, "UV_CONSTRAINT": f"{env['UV_CONSTRAINT']} {torch}", "UV_COMPILE_BYTECODE": "0",
                    "PIP_CONSTRAINT": f"{env['PIP_CONSTRAINT']} {torch}"}
        if uv:
            session.run("uv", "venv", "--quiet", "--python", sys.executable, str(venv), env=env)
            session.run("uv", "pip", "install", "--quiet", "--python", python, str(wheel), env=deps_env)
        else:
            session.run(sys.executable, "-m", "venv", str(venv), external=True)
            session.run(python, "-m", "pip", "install", "--quiet", "--no-compile", str(wheel), env=deps_env,
                        external=True)
        assert (venv / "bin" / PACKAGE).is_file(), "the wheel installed no `torchpatches` command"
        with session.chdir(tmp):  # not the checkout, so the installed package is the one imported
            session.run(python, "-c", check, str(ROOT), "wheel", external=True)
            session.run(python, "-m", PACKAGE, silent=True, external=True)  # its output is shown if it fails
        session.log(f"packaging: python -m {PACKAGE} exited 0 in the wheel's environment")

        for name, steps in {
            "editable": [["-e", str(ROOT)]],
            "wheel": [[str(ROOT)]],
            "editable, no build isolation": [["setuptools>=70.1"], ["--no-build-isolation", "-e", str(ROOT)]],
        }.items():
            session.log(f"packaging: {name}")
            venv = Path(tmp) / ("venv-" + name.replace(",", "").replace(" ", "-"))
            session.run(sys.executable, "-m", "venv", str(venv), external=True)
            python = str(venv / "bin" / "python")
            for args in steps:
                session.run(python, "-m", "pip", "install", "--no-deps", *args, env=env, external=True)
            with session.chdir(tmp):  # not the checkout, so a wheel install is found in site-packages
                session.run(python, "-c", check, str(ROOT), "editable" if "editable" in name else "wheel",
                            external=True)
    session.log(f"packaging: {time.monotonic() - started:.0f} s")
