"""Record groups as the buffer delivers them, and the order in which the trainer should use them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Record = dict[str, Any]


@dataclass
class RecordGroup:
    """The records of one `(instance_id, epoch)` group, in delivery order."""

    instance_id: str
    epoch: int
    records: list[Record]
    arrival: int  # position among all groups received by this adapter call

    @property
    def newest_timestamp(self) -> float | None:
        """Latest `extra_info.timestamp` of the group (or top-level `timestamp`, as slime reads it)."""
        stamps = []
        for r in self.records:
            value = r.get("timestamp", (r.get("extra_info") or {}).get("timestamp"))
            if value is None:
                continue
            try:
                stamps.append(float(value))
            except (TypeError, ValueError):
                continue
        return max(stamps) if stamps else None


def _epoch(record: Record) -> int:
    try:
        return int((record.get("extra_info") or {}).get("epoch", 0) or 0)
    except (TypeError, ValueError):
        return 0


def split_groups(records: list[Record], first_arrival: int = 0) -> list[RecordGroup]:
    """Cut a delivery into its groups: the buffer sends whole groups, each group's records contiguous."""
    groups: list[RecordGroup] = []
    for record in records:
        key = (str(record["instance_id"]), _epoch(record))
        last = groups[-1] if groups else None
        if last is not None and (last.instance_id, last.epoch) == key:
            last.records.append(record)
        else:
            groups.append(RecordGroup(key[0], key[1], [record], first_arrival + len(groups)))
    return groups


def newest_first(groups: list[RecordGroup]) -> list[RecordGroup]:
    """Newest groups first, as slime's `select_rollout_data` picks them.

    Groups are ranked by their latest timestamp, then by arrival (generation order, since the buffer
    delivers oldest first); like slime, a group without any timestamp counts as oldest.
    """
    return sorted(
        groups,
        key=lambda g: (g.newest_timestamp is not None, g.newest_timestamp or 0.0, g.arrival),
        reverse=True,
    )
