"""What a trainer replays beside a trajectory's tokens, asked per run (docs/consistency.md): the experts an MoE
model routed each token to (`return_routed_experts`, slime's `--use-rollout-routing-replay`), the ids top-p
sampling kept (`top_p_replay`, on by default when `top_p` < 1, as slime asks), and a teacher engine's log-probs of
the response (`teacher_engine_url`, slime's on-policy distillation).

Each engine turn asks for the first two (`ReplayAsk`, from what the conversation holds); a finished
conversation's record gets the routed-expert rows of its tokens after the last turn (the template's closing, which
no turn's answer covers) and its teacher log-probs from one prefill request each (`complete`).
"""

from __future__ import annotations

from typing import Any

from rollout_buffer.engine.client import EngineClient
from rollout_buffer.engine.replay import ReplayAsk
from rollout_buffer.engine.sglang_wire import EnginePrompt
from rollout_buffer.generation.options import SignalOptions
from rollout_buffer.tokens.conversation import Conversation
from rollout_buffer.tokens.image_tokens import image_prompt


class TrainerSignals:
    """A run's trainer signals: what each engine turn asks for, and what a finished conversation's record gets."""

    def __init__(self, options: SignalOptions, sampling_params: dict[str, Any], teacher: EngineClient | None):
        self.routed = options.return_routed_experts
        self.top_p = options.top_p(sampling_params)
        self.teacher = teacher
        self.temperature = float(sampling_params.get("temperature", 1.0))

    def ask(self, conv: Conversation) -> ReplayAsk:
        """What the next engine turn of `conv` asks for besides its tokens."""
        return ReplayAsk(routed_from=conv.routed_rows if self.routed else None, routed_width=conv.routed_width,
                         top_p=self.top_p)

    async def complete(self, conv: Conversation, engine: EngineClient, session_id: str,
                       image_data: list[str] | None = None) -> dict[str, Any]:
        """Make `conv`'s routed-expert rows cover its tokens (the template's closing after its last turn) and
        return the record fields of its teacher log-probs, the engines given its images (`image_data`) as for its
        turns. EngineError when an engine fails."""
        tokens = conv.token_ids
        if self.routed and conv.routed_rows < len(tokens) - 1:
            result = await engine.generate(_prompt(conv), {"max_new_tokens": 0, "temperature": 0.0},
                                           session_id=session_id, return_logprob=False,
                                           replay=ReplayAsk(routed_from=conv.routed_rows,
                                                            routed_width=conv.routed_width), image_data=image_data)
            if result.replay is not None:
                conv.extend_routed(result.replay)
        if self.teacher is None:
            return {}
        response = len(tokens) - conv.prompt_length
        log_probs = await self.teacher.prompt_log_probs(_prompt(conv) if conv.images else list(tokens), response,
                                                        self.temperature, session_id=session_id,
                                                        image_data=image_data)
        return {"teacher_log_probs": log_probs}


def _prompt(conv: Conversation) -> EnginePrompt:
    """The conversation's ids as the engine gets them: their JSON written as it grew, or one pad an image."""
    tokens = conv.token_ids
    return image_prompt(tokens, conv.images) if conv.images else EnginePrompt(len(tokens), conv.ids_json())
