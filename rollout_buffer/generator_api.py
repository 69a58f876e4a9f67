"""The generator API: every name a generator (`generators/`, `--generator-path`, an installed plugin) imports of
the service, in one module. What is not here is the service's own and may change between releases.

    from rollout_buffer.generator_api import RolloutContext

See the generators guide (docs/generators.md) for what each does.
"""

from rollout_buffer.engine.client import EngineClient
from rollout_buffer.engine.results import EngineError
from rollout_buffer.environments.openenv_client import OpenEnvSession, StepResult, is_mcp
from rollout_buffer.environments.openenv_servers import PORT_PLACEHOLDER, OpenEnvServer, ServerSpec
from rollout_buffer.environments.pool import EnvError, ProcessPool
from rollout_buffer.environments.venvs import venv_python
from rollout_buffer.environments.workers import (
    EnvLoadError,
    EnvWorker,
    EnvWorkerDied,
    WorkerSpec,
    python_env_paths,
    worker_script,
)
from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.inputs import existing_path, iter_json_objects
from rollout_buffer.generation.options import RunOptions
from rollout_buffer.generation.sessions import AgentSession
from rollout_buffer.policy import Governed, Policy, PolicyRefused
from rollout_buffer.processes import fate_shared, give_to, scratch_folder, user_ids
from rollout_buffer.schemas import Trajectory, check_http_urls
from rollout_buffer.tokens.conversation import Conversation
from rollout_buffer.tokens.hermes import ToolCall, parse_tool_calls, tool_call
from rollout_buffer.tokens.renderer import INLINE_CHARS

__all__ = [
    "INLINE_CHARS",
    "PORT_PLACEHOLDER",
    "AgentSession",
    "Conversation",
    "EngineClient",
    "EngineError",
    "EnvError",
    "EnvLoadError",
    "EnvWorker",
    "EnvWorkerDied",
    "Governed",
    "OpenEnvServer",
    "OpenEnvSession",
    "Policy",
    "PolicyRefused",
    "ProcessPool",
    "RolloutContext",
    "RunOptions",
    "RunResources",
    "ServerSpec",
    "StepResult",
    "ToolCall",
    "Trajectory",
    "WorkerSpec",
    "check_http_urls",
    "existing_path",
    "fate_shared",
    "give_to",
    "is_mcp",
    "iter_json_objects",
    "parse_tool_calls",
    "python_env_paths",
    "scratch_folder",
    "tool_call",
    "user_ids",
    "venv_python",
    "worker_script",
]
