"""Weight versions and admission control in isolation: SGLang's version strings as numbers, the off-policy
mask, the trainer's version bookkeeping, and AReaL's capacity rule counted in groups."""

from __future__ import annotations

import asyncio

import pytest

from rollout_buffer.delivery.ledger import GroupTally, RunLedger, StreamLedger
from rollout_buffer.delivery.versions import (
    StalenessRule,
    TrainerVersion,
    VersionConflict,
    engine_version,
    group_version_range,
    mask_older_versions,
    version_range,
)
from rollout_buffer.generation.admission import AdmissionController, AdmissionPolicy, AdmissionState


@pytest.mark.parametrize(
    ("reported", "number"),
    [("7", 7), ("000007", 7), (" 3 ", 3), (5, 5), ("default", 0), ("step-7", None), ("", None), (None, None),
     (True, None), (-1, None), ("1.5", None)],
)
def test_sglang_weight_versions_as_numbers(reported: object, number: int | None) -> None:
    assert engine_version(reported) == number


def test_a_records_range_prefers_the_runners_fields_over_its_version_list() -> None:
    assert version_range({"extra_info": {"weight_version_min": "2", "weight_version_max": "5"},
                          "weight_versions": ["9"]}) == (2, 5)
    assert version_range({"extra_info": {}, "weight_versions": ["4", "default", "hash-x"]}) == (0, 4)
    assert version_range({"extra_info": {}, "weight_versions": ["hash-x"]}) is None
    records = [{"weight_versions": ["3"]}, {"weight_versions": ["1", "6"]}, {"weight_versions": []}]
    assert group_version_range(records) == (1, 6)
    assert group_version_range([{"weight_versions": None}]) == (None, None)


def test_offpolicy_mask_zeroes_only_tokens_of_older_known_versions() -> None:
    mask = [0, 0, 1, 1, 1, 1, 0, 1, 1]
    spans = [(2, 4, "3"), (4, 6, "4"), (7, 9, "unknown-hash")]
    assert mask_older_versions(mask, spans) == 2
    assert mask == [0, 0, 0, 0, 1, 1, 0, 1, 1]
    same = [1, 1, 1]
    assert mask_older_versions(same, [(0, 3, "4")]) == 0 and same == [1, 1, 1]


def test_trainer_version_moves_forward_unless_rewound() -> None:
    v = TrainerVersion().advanced(5)
    assert (v.base, v.current, v.steps) == (5, 5, 0)
    v = v.advanced(8)
    assert (v.base, v.current, v.steps, v.lag(6), v.lag(9)) == (5, 8, 3, 2, 0)
    with pytest.raises(VersionConflict, match="current_version: 7 is older than the trainer version 8"):
        v.advanced(7)
    assert v.advanced(7, rewind=True) == TrainerVersion(5, 7)
    assert TrainerVersion().lag(3) is None and v.lag(None) is None


def test_staleness_rule_of_a_run() -> None:
    assert StalenessRule.of_run({}) is None
    assert StalenessRule.of_run({"max_staleness": "1", "regenerate_stale": True}) == StalenessRule(1, True)


def admission(ledger: RunLedger, eta: int | None = 1, batch: int = 2, cap: int | None = None,
              started: int = 0) -> AdmissionController:
    return AdmissionController(AdmissionPolicy(eta, batch, cap), ledger, started)


def test_capacity_is_arreals_rule_in_groups() -> None:
    async def run() -> None:
        ledger = RunLedger("r", {"": StreamLedger(version=TrainerVersion(10, 10))})
        ctl = admission(ledger, eta=1, batch=2)
        for _ in range(4):  # (η + 1) × B
            await asyncio.wait_for(ctl.admit(), 1)
        assert ctl.evaluate() is AdmissionState.PAUSED_STALENESS and ctl.capacity() == 0
        blocked = asyncio.create_task(ctl.admit())
        await asyncio.sleep(0.01)
        assert not blocked.done() and ctl.state is AdmissionState.PAUSED_STALENESS
        for _ in range(4):
            ledger.completed(dropped=False)
        ledger.taken(groups=2, expired=0, stale=0)  # the batch it trains on with version 10 releases nothing
        await asyncio.sleep(0.01)
        assert not blocked.done()
        ledger.reported(TrainerVersion(10, 11))  # its next version does
        await asyncio.wait_for(blocked, 1)
        assert ctl.started == 5 and ctl.capacity() == 1 and ctl.groups_ahead() == 3
        ledger.taken(groups=2, expired=0, stale=0)  # a second batch without a new version: consumption counts
        assert ctl.steps() == 1
        ledger.taken(groups=2, expired=0, stale=0)
        assert ctl.steps() == 2 and ctl.capacity() == 3
        ledger.completed(dropped=True)  # a dropped group gives its place back
        assert ctl.capacity() == 4 and ctl.live_groups() == 4

    asyncio.run(run())


def test_a_trainer_that_reports_no_version_is_followed_by_its_fetches() -> None:
    ledger = RunLedger("r", {"": StreamLedger(GroupTally(ready=2))})
    ctl = admission(ledger, eta=0, batch=2, started=2)
    assert ctl.evaluate() is AdmissionState.PAUSED_STALENESS
    ledger.taken(groups=2, expired=0, stale=0)
    assert ctl.steps() == 1 and ctl.capacity() == 2 and ctl.evaluate() is AdmissionState.RUNNING


def test_a_lease_that_runs_out_takes_the_consumption_back() -> None:
    ledger = RunLedger("r", {"": StreamLedger(GroupTally(ready=2))})
    ledger.taken(groups=2, expired=0, stale=0)
    ledger.taken(groups=0, expired=2, stale=0)
    assert (ledger.tally.ready, ledger.tally.consumed) == (2, 0)
    ledger.taken(groups=1, expired=0, stale=1)
    assert ledger.tally == GroupTally(ready=0, consumed=1, dropped=1)


def test_ready_cap_pauses_independently_and_unbounded_never_pauses() -> None:
    ledger = RunLedger("r", {"": StreamLedger(GroupTally(ready=2, consumed=5))})
    assert admission(ledger, eta=None, cap=3, started=8).evaluate() is AdmissionState.PAUSED_CAP  # 3 ahead
    assert admission(ledger, eta=None, cap=4, started=8).evaluate() is AdmissionState.RUNNING
    unbounded = admission(ledger, eta=None, started=10_000)
    assert unbounded.capacity() is None and unbounded.evaluate() is AdmissionState.RUNNING
    # A resumed run counts what the store already has as started.
    assert admission(RunLedger("r"), eta=0, batch=2, started=2).evaluate() is AdmissionState.PAUSED_STALENESS
