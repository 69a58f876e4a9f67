"""A single-turn verifiers environment whose prompts hold images (verifiers' own `image_url` content parts): a card
of one colour, scored on the reply naming it."""

import verifiers.v1 as vf

# 64x48 PNGs of one colour each, base64.
CARDS = {
    "red": (
        "iVBORw0KGgoAAAANSUhEUgAAAEAAAAAwCAIAAAAuKetIAAAAUklEQVR4nO3PMQ0AIADAMEAI/kUhBhEcDcmqYJtn7/GzpQNeNaA1"
        "oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oDWgNaA1oF2C8AF4XXzSpwAAAABJRU5ErkJggg=="
    ),
    "blue": (
        "iVBORw0KGgoAAAANSUhEUgAAAEAAAAAwCAIAAAAuKetIAAAAVUlEQVR4nO3PQQ3AIADAQEAISvCvAjETweOypKegnfvc8WdLB7xq"
        "QGtAa0BrQGtAa0BrQGtAa0BrQGtAa0BrQGtAa0BrQGtAa0BrQGtAa0BrQGtA+wC/FAGWo878+gAAAABJRU5ErkJggg=="
    ),
}


class CardData(vf.TaskData):
    colour: str


class CardTask(vf.Task[CardData]):
    @vf.reward
    async def named(self, trace) -> float:
        return 1.0 if self.data.colour in (trace.last_reply or "").lower() else 0.0


class CardTaskset(vf.Taskset[CardTask]):
    def load(self):
        for colour, png in CARDS.items():
            prompt = [{"role": "user", "content": [
                {"type": "text", "text": "What colour is this card?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}]
            yield CardTask(CardData(id=f"card-{colour}", prompt=prompt, colour=colour), self.config.task)


__all__ = ["CardTaskset"]
