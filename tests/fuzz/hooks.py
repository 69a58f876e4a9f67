"""schemathesis hooks of the API fuzz test (loaded through SCHEMATHESIS_HOOKS).

The long-polls (`/get_rollout_data`, `/eval_results`) legitimately wait `wait_s` (up to 600 s): a valid wait is
shortened to half a second so every request ends well inside the fuzzer's request timeout. Invalid waits are
sent as generated (they are refused at once).
"""

from __future__ import annotations

from typing import Any

import schemathesis

LONG_POLLS = {"/get_rollout_data", "/eval_results"}
MAX_WAIT_S = 0.5


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    body = case.body
    if case.operation.path in LONG_POLLS and isinstance(body, dict):
        wait = body.get("wait_s")
        if isinstance(wait, int | float) and not isinstance(wait, bool) and MAX_WAIT_S < wait <= 600:
            body["wait_s"] = MAX_WAIT_S
