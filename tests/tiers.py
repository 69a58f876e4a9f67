"""Every test module's tier, as a marker on each of its tests: `unit` (no process, no socket), `service` (the
buffer's pieces or a server in this process, on loopback sockets) and `system` (processes: servers, kill -9,
venvs, npm agents, Chromium, Docker, Ray). `pytest -m unit`, `pytest -m "unit or service"` run the fast tiers;
README's `pytest -q` runs all three. tests/test_layout.py holds each tier to what it may import."""

from __future__ import annotations

import pytest

UNIT = frozenset({
    "test_vision",
    "test_adapter_flags", "test_adapter_loss_mask", "test_adapter_meta_info", "test_adapter_records",
    "test_adapter_run_control", "test_adapter_selection", "test_renderer", "test_conversation",
    "test_dependency_internals", "test_groups", "test_history_cache", "test_layout", "test_math_reward",
    "test_record_encoding", "test_record_layout", "test_request_bodies", "test_run_options", "test_scheduler",
    "test_session_files",
    "test_sim_policy", "test_session_backends", "test_session_expiry", "test_store_batches", "test_template_sandbox",
    "test_tools", "test_versions",
})
SERVICE = frozenset({"test_fast_routes", "test_http_protocol", "test_sglang_exchanges", "test_weight_watch"})
TIERS = ("unit", "service", "system")


def tier_of(module: str) -> str:
    """The tier of the test module named `module` (its file's stem)."""
    return "unit" if module in UNIT else "service" if module in SERVICE else "system"


def pytest_configure(config: pytest.Config) -> None:
    for tier, what in zip(TIERS, ("no process, no socket", "servers in this process, on loopback",
                                  "processes: servers, kill -9, venvs, agents, browsers, Ray"), strict=True):
        config.addinivalue_line("markers", f"{tier}: {what}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item.path.stem)))
