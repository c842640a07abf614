"""What every policy contract has: a named observation layout, the action size and range, and
the control period; serialised to JSON for the exported model's metadata and compared on load.

Each robot writes its contract once (sim/crazyflie/contract.py, sim/arm/contract.py) as a frozen
dataclass deriving from ``ContractBase``, with robot-specific fields of its own.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Field:
    name: str
    size: int
    frame: str
    unit: str


class ContractBase:
    """Mixin for a frozen dataclass with ``observation: tuple[Field, ...]``, ``action_size``,
    ``version`` and the other fields that make up the contract. ``EARLIER_VERSIONS`` (a class
    attribute, not part of the serialised contract) names the versions before ``version``: a policy
    record saved before records carried their version (2026-11-29) is trusted only where there are none."""

    EARLIER_VERSIONS: tuple[str, ...] = ()

    @property
    def obs_size(self) -> int:
        return sum(f.size for f in self.observation)

    def slice(self, name: str) -> slice:
        """Where the observation field ``name`` is in the observation vector."""
        start = 0
        for f in self.observation:
            if f.name == name:
                return slice(start, start + f.size)
            start += f.size
        raise KeyError(f"no observation field {name!r} in contract {self.version}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def mismatch(self, other_json: str) -> list[str]:
        """Names of contract fields that differ from a serialized contract ([] if equal)."""
        try:
            other = json.loads(other_json)
        except (TypeError, ValueError):
            return ["<contract is not valid JSON>"]
        mine = json.loads(self.to_json())
        return sorted(k for k in set(mine) | set(other) if mine.get(k) != other.get(k))
