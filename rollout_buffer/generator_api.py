"""The generator API: every name a generator (`generators/`, `--generator-path`, an installed plugin) imports of
the service, in one module. What is not here is the service's own and may change between releases.

    from rollout_buffer.generator_api import RolloutContext

See the generators guide (docs/generators.md) for what each does.
"""

from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.conversation import Conversation
from rollout_buffer.generation.engine import EngineClient
from rollout_buffer.generation.engine_results import EngineError
from rollout_buffer.generation.hermes import ToolCall, parse_tool_calls, tool_call
from rollout_buffer.generation.inputs import confined_path, iter_json_objects
from rollout_buffer.generation.options import RunOptions
from rollout_buffer.generation.prompt_ids import INLINE_CHARS
from rollout_buffer.generation.sessions import AgentSession
from rollout_buffer.schemas import check_http_urls

__all__ = [
    "INLINE_CHARS",
    "AgentSession",
    "Conversation",
    "EngineClient",
    "EngineError",
    "RolloutContext",
    "RunOptions",
    "RunResources",
    "ToolCall",
    "check_http_urls",
    "confined_path",
    "iter_json_objects",
    "parse_tool_calls",
    "tool_call",
]
