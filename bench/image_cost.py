"""What images cost (docs/multimodal.md): a screenshot agent's sessions, paired.

Two buffers at once on one simulated engine serving a Qwen-VL-style checkpoint (`rollout_sim.vision_checkpoint`):
each runs `--sessions` agents of `--turns` turns; each turn the agent resends its whole history plus one new
`--width`×`--height` screenshot (a PNG of windows and text lines, different every turn). The candidate's agents
send the screenshots; the baseline's send the same turns with a one-line text in place of each image (or, with
`--aa`, both buffers do: the pair's own spread). Printed: each buffer's CPU per turn and their ratio, the extra CPU
per turn in ms; the images the candidate stored against those its agents sent (each screenshot once, however
often a history resent it), the bytes stored per image against its PNG, and a record's JSON size (images are named
by hash, never inlined).

    python -m bench.image_cost                  # 16 sessions x 20 turns of 1280x800, 3 rounds
    python -m bench.image_cost --aa             # the A/A spread
    python -m bench.image_cost --quick
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import random
import tempfile
from pathlib import Path
from typing import Any

import httpx
from PIL import Image, ImageDraw
from rich.console import Console

from bench.harness import Meter, Service, rollout_buffer, sim_engine
from rollout_sim.vision_checkpoint import vision_checkpoint

console = Console(width=160)


def screenshot(seed: int, width: int, height: int) -> bytes:
    """A desktop-like PNG: a background, a few windows with title bars and lines of "text"."""
    rng = random.Random(seed)
    img = Image.new("RGB", (width, height), (rng.randrange(40, 90), rng.randrange(60, 110), rng.randrange(90, 140)))
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(2, 5)):
        x, y = rng.randrange(0, width * 2 // 3), rng.randrange(0, height * 2 // 3)
        w, h = rng.randrange(width // 4, width // 2), rng.randrange(height // 4, height // 2)
        draw.rectangle((x, y, x + w, y + h), fill=(245, 245, 245), outline=(120, 120, 120))
        draw.rectangle((x, y, x + w, y + 22), fill=(rng.randrange(200), rng.randrange(200), 230))
        for line in range(y + 34, y + h - 10, 18):
            draw.text((x + 10, line), "".join(rng.choice("abcdefghij klmnopqrst") for _ in range(w // 9)),
                      fill=(30, 30, 30))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def _turn_message(k: int, image: bytes | None) -> dict[str, Any]:
    text = {"type": "text", "text": f"Turn {k}: the screen now. What next?"}
    if image is None:
        return {"role": "user", "content": [text, {"type": "text", "text": f"(screenshot {k} left out)"}]}
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": url}}]}


async def _agent(http: httpx.AsyncClient, images: list[bytes] | None, turns: int) -> tuple[int, str]:
    """One session of `turns` turns, its whole history resent each turn; its turns and its record's uid."""
    opened = (await http.post("/sessions", json={"instance_id": "screens"})).raise_for_status().json()
    url, headers = f"{opened['base_url']}/chat/completions", {"authorization": f"Bearer {opened['api_key']}"}
    history: list[dict[str, Any]] = []
    for k in range(turns):
        history.append(_turn_message(k, images[k] if images is not None else None))
        answer = await http.post(url, headers=headers, json={"model": "policy", "messages": history, "max_tokens": 16})
        history.append({"role": "assistant", "content": answer.raise_for_status().json()["choices"][0]["message"][
            "content"]})
    done = await http.post(f"/sessions/{opened['session_id']}/finish", json={"reward": 1.0})
    return turns, str(done.raise_for_status().json()["uids"][0])


async def _round(buffers: list[Service], shots: list[list[list[bytes] | None]], turns: int
                 ) -> tuple[list[float], list[str]]:
    """Each buffer's CPU ms per turn over one round (both at once), and the candidate's record uids."""
    async def drive(i: int) -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=buffers[i].url, timeout=300) as client:
            return list(await asyncio.gather(*(_agent(client, s, turns) for s in shots[i])))

    with contextlib.ExitStack() as stack:
        meters = [stack.enter_context(Meter(b.pid, children=False)) for b in buffers]
        results = await asyncio.gather(*(drive(i) for i in range(len(buffers))))
        cpu = [m.usage().cpu_s for m in meters]
    per_turn = [1000 * cpu[i] / sum(t for t, _ in results[i]) for i in range(len(buffers))]
    return per_turn, [uid for _, uid in results[1]]


def _start(buffer: Service, engine: Service, checkpoint: Path) -> None:
    httpx.post(f"{buffer.url}/start_rollout", timeout=60, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": str(checkpoint),
        "num_repeat_per_sample": 1, "max_tokens": 16_384}).raise_for_status()


def _stored(data_dir: Path) -> tuple[int, int]:
    files = [p for p in (data_dir / "images").rglob("*") if p.is_file() and not p.name.startswith(".")]
    return len(files), sum(p.stat().st_size for p in files)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16, help="agents per buffer and round")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--aa", action="store_true", help="both buffers' agents send text only")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.rounds = 2, 6, 1
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-images-"))
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = vision_checkpoint(workdir / "checkpoint")
    ratios, extra_ms, sent, png_bytes = [], [], 0, 0
    with sim_engine(workdir, args.latency_ms, 0, "--tokenizer", str(checkpoint)) as engine, \
            rollout_buffer(workdir) as base, rollout_buffer(workdir) as cand:
        for buffer in (base, cand):
            _start(buffer, engine, checkpoint)
        for r in range(args.rounds):
            shots = [[[screenshot(10_000 * r + 100 * s + k, args.width, args.height) for k in range(args.turns)]
                      for s in range(args.sessions)]]
            candidate_shots: list[list[bytes] | None] = [None] * args.sessions if args.aa else list(shots[0])
            if not args.aa:
                sent += args.sessions * args.turns * (args.turns + 1) // 2
                png_bytes += sum(len(b) for s in shots[0] for b in s)
            (base_ms, cand_ms), uids = asyncio.run(_round([base, cand], [[None] * args.sessions, candidate_shots],
                                                          args.turns))
            ratios.append(cand_ms / base_ms)
            extra_ms.append(cand_ms - base_ms)
            console.print(f"round {r + 1}: baseline {base_ms:.2f} ms/turn | candidate {cand_ms:.2f} ms/turn | "
                          f"candidate/baseline {ratios[-1]:.3f}")
        record = httpx.get(f"{cand.url}/trajectories/{uids[0]}", timeout=30).content
        stored, stored_bytes = _stored(workdir / f"data-{cand.port}")
    what = "A/A (text only)" if args.aa else f"{args.width}x{args.height} screenshots / text"
    parts = [f"CPU per turn, {what}: {sum(ratios) / len(ratios):.3f} "
             f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)}), {sum(extra_ms) / len(extra_ms):+.2f} ms a turn"]
    if not args.aa:
        made = args.rounds * args.sessions * args.turns
        parts.append(f"images sent {sent}, stored {stored} of {made} distinct, {stored_bytes / max(png_bytes, 1):.3f}x "
                     f"their PNG bytes ({png_bytes / made / 1e3:.0f} KB an image); a {args.turns}-turn record's JSON "
                     f"{len(record) / 1e3:.0f} KB")
    console.print(f"SUMMARY image cost {args.sessions}x{args.turns} turns: {'; '.join(parts)}", soft_wrap=True)


if __name__ == "__main__":
    main()
