"""The generator API under its first name: `from rollout_buffer.context import RolloutContext`.

Everything a generator touches lives in `rollout_buffer.generation`; these are the names generators import.
"""

from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.conversation import Conversation
from rollout_buffer.generation.engine import EngineClient, EngineError

__all__ = ["Conversation", "EngineClient", "EngineError", "RolloutContext", "RunResources"]
