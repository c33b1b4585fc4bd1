"""One difference between upstream and the reimpl: what kind, at which step, in which field, both values."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Divergence:
    kind: str  # "tokens" | "decision" | "tensor" | "missing"
    step: int | None
    field: str  # dotted path, e.g. "scheduler.scheduled[r1].num_scheduled_tokens"
    upstream: Any = None
    reimpl: Any = None
    req_id: str | None = None
    message: str = ""

    def to_json(self) -> dict:
        return asdict(self)
