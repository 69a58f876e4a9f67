"""The records session workers hand the buffer (`POST /workers/records`, a stopping worker's outbox), stored in
their run: a batch's parts (one finished session's records each) are decoded apart, so that a malformed one is
refused alone, and a run's parts are stored together, in one write (each write costs the store more than the
records it carries)."""

from __future__ import annotations

from typing import Any

from rollout_buffer.delivery.encoded import EncodedRecord, decode_wire
from rollout_buffer.generation.run_manager import RunManager


async def store(runs: RunManager, run_id: str, records: list[EncodedRecord]) -> None:
    """Store records of `run_id`: in the run when it is running, else straight in the store (ValueError when the
    run is gone)."""
    run = runs.running(run_id)
    if run is not None:
        await run.accept_encoded(records)
        return
    row = await runs.buffer.runs.get(run_id)
    if row is None:
        raise ValueError(f"records: no run {run_id!r}")
    await runs.buffer.write_encoded(records, row)


async def store_parts(runs: RunManager, parts: list[Any]) -> dict[str, str]:
    """Store a batch's `{"run_id", "records"}` parts, a run's together. Returns the parts refused for good
    (malformed, or their run gone), by index, each with why."""
    by_run: dict[str, list[tuple[int, list[EncodedRecord]]]] = {}
    refused: dict[str, str] = {}
    for i, part in enumerate(parts):
        try:
            by_run.setdefault(str(part["run_id"]), []).append((i, decode_wire(part["records"])))
        except (KeyError, TypeError, ValueError) as e:  # pydantic's ValidationError is a ValueError
            refused[str(i)] = f"records[{i}]: {e}"
    for run_id, members in by_run.items():
        try:
            await store(runs, run_id, [record for _, records in members for record in records])
        except ValueError as e:  # the run is gone: every part of it is refused
            refused.update((str(i), f"records[{i}]: {e}") for i, _ in members)
    return refused
