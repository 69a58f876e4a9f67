"""A run's options judged by the server's policy (`rollout_buffer.policy`): before it starts, and again when a
restarted server resumes it (the operator may have tightened the policy in between).

Which options are governed is declared where each is defined: a `Governed` marker on the field of
`/start_rollout`'s schema or of a `RunOptions` class (a generator's, the sessions', the executor's). Every such
option a payload names is checked, whichever generator reads it; the sandbox options a run leaves out get the
server's value (`Governed.fill`) when the run's generator reads them.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

from pydantic import BaseModel

from rollout_buffer.generation.options import RunOptions, run_option_classes
from rollout_buffer.policy import Governed, Policy
from rollout_buffer.schemas import StartEvalRequest, StartRolloutRequest


def governed_fields(models: Iterable[type[BaseModel]]) -> dict[str, Governed]:
    """The governed fields of `models`, by option name."""
    found: dict[str, Governed] = {}
    for model in models:
        for name, field in model.model_fields.items():
            marker = next((m for m in field.metadata if isinstance(m, Governed)), None)
            if marker is not None:
                found.setdefault(name, marker)
    return found


def options_read_by(module: ModuleType) -> list[type[RunOptions]]:
    """The run option classes a generator module holds (defined or imported there)."""
    return [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, RunOptions)
            and v is not RunOptions]


def check_run(payload: dict[str, Any], policy: Policy, generator: ModuleType | None) -> dict[str, Any]:
    """Judge every governed option `payload` names (PolicyRefused naming the first the policy refuses; ValueError
    for a malformed one) and return the sandbox options to add: those the run's `generator` reads and the payload
    leaves out, at the policy's values. The generator's own options are validated first: a malformed request is
    told what is wrong with it (422) before what it may not do (403)."""
    own = options_read_by(generator) if generator is not None else []
    for options in own:
        options.from_run(payload)
    governed = governed_fields([StartRolloutRequest, StartEvalRequest, *run_option_classes()])
    read = governed_fields(own)
    # The server's own setting, whatever a client sent: the hosts a router's worker list may lead the engine client
    # to (`EngineClient`), wherever the run's trajectories run.
    filled: dict[str, Any] = {"engine_hosts": list(policy.engine_hosts)} if policy.engine_hosts else {}
    if not policy.engine_hosts and "engine_hosts" in payload:
        filled["engine_hosts"] = []
    for name, marker in governed.items():
        if marker.unless is not None and payload.get(marker.unless[0]) == marker.unless[1]:
            continue
        if name in payload and payload[name] is not None:
            policy.check(name, marker.kind, payload[name])
        elif marker.fill and name in read and (value := policy.check(name, marker.kind, None)) is not None:
            filled[name] = value
    return filled
