"""The coverage report: per fusion pattern and class, the calls fused and those handed to diffusers' code with
the reason; the model's classes a pattern targets that is not applied; those no pattern targets; the timing."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

SCHEMA = "torchpatches.coverage/1"
EXAMPLES = 3  # module names shown per row


@dataclasses.dataclass
class CoverageReport:
    target: str
    versions: Dict[str, str]
    #: {"pattern", "class", "fused": bool, "calls", "reason" (None when fused), "modules": names (a few)}
    rows: List[Dict[str, Any]]
    #: {"class", "instances", "pattern", "state", "reason"}: classes targeted by a pattern that is not applied
    not_applied: List[Dict[str, Any]]
    #: {"class", "instances"}: the model's classes no fusion pattern targets
    untargeted: List[Dict[str, Any]]
    timing: Optional[Dict[str, Any]] = None

    def fused_calls(self, pattern: Optional[str] = None) -> int:
        return sum(row["calls"] for row in self.rows if row["fused"] and pattern in (None, row["pattern"]))

    def declined_calls(self, pattern: Optional[str] = None) -> int:
        return sum(row["calls"] for row in self.rows if not row["fused"] and pattern in (None, row["pattern"]))

    def reasons(self, pattern: Optional[str] = None) -> List[str]:
        return [row["reason"] for row in self.rows if not row["fused"] and pattern in (None, row["pattern"])]

    def to_json(self) -> Dict[str, Any]:
        return {"schema": SCHEMA, **dataclasses.asdict(self)}

    def __str__(self) -> str:
        versions = ", ".join(f"{name} {version}" for name, version in self.versions.items())
        out = [f"torchpatches coverage: {self.target} ({versions})"]
        if self.rows:
            out.append(f"{'pattern':<24} {'class':<34} {'fused':>6} {'diffusers':>9}  why diffusers' code ran")
            for row in self.rows:
                fused, declined = (row["calls"], 0) if row["fused"] else (0, row["calls"])
                why = row["reason"] or ""
                where = f"  [{', '.join(row['modules'])}]" if row["modules"] and not row["fused"] else ""
                out.append(f"{row['pattern']:<24} {row['class']:<34} {fused:>6} {declined:>9}  {why}{where}")
        else:
            out.append("no fusion pattern ran: the call reached no patched method")
        for row in self.not_applied:
            out.append(f"not applied: {row['pattern']} ({row['state']}: {row['reason']}) targets {row['class']} "
                       f"x{row['instances']}")
        if self.untargeted:
            listed = ", ".join(f"{row['class']} x{row['instances']}" for row in self.untargeted)
            out.append(f"no pattern targets: {listed}")
        out.append(_timing_line(self.timing))
        return "\n".join(line for line in out if line)


def _timing_line(timing: Optional[Dict[str, Any]]) -> str:
    if not timing:
        return ""
    if "skipped" in timing:
        return timing["skipped"]
    return (f"time (CUDA events, median of {timing['rounds']} alternated calls): eager {timing['eager_ms']:.2f} ms, "
            f"eager + torchpatches {timing['torchpatches_ms']:.2f} ms: {timing['ratio']:.3f}x")
