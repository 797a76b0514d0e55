"""Fingerprint the diffusers patches' targets in several diffusers releases (where README's tables come from).

    python tools/fingerprint_diffusers.py 0.35.2 0.40.0 0.41.0 0.42.1
    python tools/fingerprint_diffusers.py --json out.json 0.39.0

Each release's wheel (pure Python) is downloaded with ``pip download --no-deps`` into ``--cache``
(default ``.cache/diffusers-wheels``), unpacked beside it and imported in a subprocess of the running
Python with that directory first on ``sys.path`` and every patch disabled, so the fingerprints are of
diffusers' own objects (``torchpatches._core.gates.fingerprint``). The running Python needs torch and
diffusers' dependencies (any nox test environment has them). A ``*`` marks a fingerprint the patch
already accepts.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]

_SCAN = r"""
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
import diffusers
from torchpatches._core.gates import fingerprint
from torchpatches._core.slot import SkipTarget, find
from torchpatches.patches import (compile_warnings, cp_all_to_all, cp_ring_attention, cp_ulysses_anything, lora_scale,
                                  qwenimage_text_seq_len, rope)

def look(path):
    try:
        module = importlib.import_module(path.split(":")[0])
    except ImportError:
        return "no module"
    try:
        return fingerprint(find(module, path)[2])  # what the registry fingerprints (a staticmethod as such)
    except SkipTarget:
        return "missing"

found = {"diffusers": diffusers.__version__, "targets": {}}
for patch in (rope.PATCH, lora_scale.PATCH, cp_all_to_all.PATCH, cp_ring_attention.PATCH, cp_ulysses_anything.PATCH,
              qwenimage_text_seq_len.PATCH,
              compile_warnings.PATCH):
    for target in patch.targets:
        value = look(target.path)
        found["targets"][target.path] = [value, value in target.fingerprints]
shared = getattr(compile_warnings, "_SHARED_CODE", None) or dict(getattr(compile_warnings.PATCH, "verifies", {}))
for path, accepted in shared.items():
    value = look(path)
    found["targets"][path] = [value, value in accepted]
print(json.dumps(found))
"""


def unpacked(version: str, cache: Path) -> Path:
    """The directory holding diffusers ``version``'s package, downloading and unpacking it if needed."""
    target = cache / version
    if (target / "diffusers").is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(cache),
                    f"diffusers=={version}"], check=True)
    wheel = next(cache.glob(f"diffusers-{version}-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def scan(version: str, cache: Path) -> Dict:
    env = dict(os.environ, TORCHPATCHES_DISABLE="all",
               PYTHONPATH=os.pathsep.join([str(unpacked(version, cache)), str(ROOT)]))
    result = subprocess.run([sys.executable, "-c", _SCAN], capture_output=True, text=True, env=env, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--cache", type=Path, default=ROOT / ".cache" / "diffusers-wheels")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    results = [scan(version, args.cache) for version in args.versions]
    for path in results[0]["targets"]:
        print(path)
        print("   " + "  ".join(
            f"{r['diffusers']}:{r['targets'][path][0]}{'*' if r['targets'][path][1] else ''}" for r in results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
