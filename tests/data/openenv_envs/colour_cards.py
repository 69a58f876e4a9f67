"""A multi-step OpenEnv environment whose observations are images, written with OpenEnv's own server library: each
step shows a card of one colour (a PNG, base64, in the observation's `image` field) and asks its colour; reward 1
for a reply naming it. Two cards an episode, the seed picks them.

    python colour_cards.py --port 8765
"""

import argparse
import base64
import random
import struct
import zlib
from typing import Any

import uvicorn
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (30, 60, 220)}
CARDS = 2


def card(rgb: tuple[int, int, int], width: int = 64, height: int = 48) -> str:
    """A PNG of one colour, base64 (written by hand: the environment's venv has no imaging library)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return base64.b64encode(png).decode()


class Reply(Action):
    message: str = Field(..., description="the colour of the card")


class Card(Observation):
    prompt: str = ""
    image: str = ""


class CardsState(State):
    colours: list[str] = Field(default_factory=list)


class ColourCards(Environment[Reply, Card, CardsState]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = CardsState(episode_id="none", step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Card:
        colours = random.Random(seed).sample(sorted(COLOURS), CARDS)
        self._state = CardsState(episode_id=episode_id or f"seed-{seed}", step_count=0, colours=colours)
        return self._show(0)

    def step(self, action: Reply, timeout_s: float | None = None, **kwargs: Any) -> Card:  # type: ignore[override]
        s = self._state
        reward = 1.0 if s.colours[s.step_count] in action.message.lower() else 0.0
        s.step_count += 1
        if s.step_count >= CARDS:
            return Card(prompt="Done.", done=True, reward=reward)
        shown = self._show(s.step_count)
        shown.reward = reward
        return shown

    def _show(self, i: int) -> Card:
        return Card(prompt="What colour is this card?", image=card(COLOURS[self._state.colours[i]]), done=False,
                    reward=None)

    @property
    def state(self) -> CardsState:
        return self._state


app = create_app(ColourCards, Reply, Card, env_name="colour_cards", max_concurrent_envs=8, state_cls=CardsState)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
