"""The ``aot_compile_builtins`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/aot_compile_builtins.py``."""
from __future__ import annotations

import builtins
import pickle
from typing import Any, Callable, Dict


def _picklable(members: Dict[str, Any]) -> Dict[str, Any]:
    """The entries of a builtins dict that pickle (upstream's ``_safe_builtins_dict``)."""
    kept = {}
    for name, value in members.items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - anything pickle refuses is left out, as upstream does
            continue
        kept[name] = value
    return kept


def make_replacement(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def get_runtime_env(self: Any) -> Any:
        """torchpatches: the builtins the bytecode reads join ``used_globals`` (pytorch#177558)."""
        env = original(self)
        for ref in env.external_refs:
            if ref in env.used_globals:
                continue
            if ref.startswith("__builtins_dict__") and ref in self.f_globals:
                env.used_globals[ref] = _picklable(self.f_globals[ref])
            elif hasattr(builtins, ref):
                env.used_globals[ref] = getattr(builtins, ref)
        return env

    return get_runtime_env
