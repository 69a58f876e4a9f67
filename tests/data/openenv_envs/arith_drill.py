"""A multi-step OpenEnv environment written with OpenEnv's own server library: three sums a seed picks, one per
step; reward 1 for a step whose reply boxes the right sum, else 0. `crash_flag` in reset kills the server the
first time (a file remembers it); `sleep_s` makes every step that slow; `unscored` gives no reward.

    python arith_drill.py --port 8765
"""

import argparse
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

QUESTIONS = 3


class Answer(Action):
    message: str = Field(..., description="the reply, its answer in \\boxed{}")


class Question(Observation):
    prompt: str = ""
    step: int = 0


class DrillState(State):
    sums: list[tuple[int, int]] = Field(default_factory=list)
    sleep_s: float = 0.0
    unscored: bool = False


class ArithDrill(Environment[Answer, Question, DrillState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = DrillState(episode_id="none", step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, crash_flag: str | None = None,
              sleep_s: float = 0.0, unscored: bool = False, **kwargs: Any) -> Question:
        if crash_flag and not Path(crash_flag).exists():
            Path(crash_flag).write_text("1")
            os._exit(7)
        rng = random.Random(seed)
        sums = [(rng.randint(2, 40), rng.randint(2, 40)) for _ in range(QUESTIONS)]
        self._state = DrillState(episode_id=episode_id or f"seed-{seed}", step_count=0, sums=sums, sleep_s=sleep_s,
                                 unscored=unscored)
        return Question(prompt=self._ask(0), step=0, done=False, reward=None)

    def step(self, action: Answer, timeout_s: float | None = None, **kwargs: Any) -> Question:  # type: ignore[override]
        s = self._state
        time.sleep(s.sleep_s)
        a, b = s.sums[s.step_count]
        found = re.findall(r"\\boxed\{([^}]*)\}", action.message)
        reward = 1.0 if found and found[-1].strip() == str(a + b) else 0.0
        s.step_count += 1
        done = s.step_count >= QUESTIONS
        prompt = "Done." if done else self._ask(s.step_count)
        return Question(prompt=prompt, step=s.step_count, done=done, reward=None if s.unscored else reward)

    def _ask(self, i: int) -> str:
        a, b = self._state.sums[i]
        return f"What is {a} + {b}? Put the answer in \\boxed{{}}."

    @property
    def state(self) -> DrillState:
        return self._state


app = create_app(ArithDrill, Answer, Question, env_name="arith_drill", max_concurrent_envs=8, state_cls=DrillState)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
