"""What the trainer signals cost (docs/consistency.md): MoE routing replay's bytes and CPU, and the buffer's CPU per
sample with routing replay and top-p replay on against off.

1. In process, one long trajectory (`--tokens`, default 32 768) of an MoE model with `--layers` (48) and
   `--top-k` (8) routed experts a token: its side data's stored bytes against the raw int32 size, the bytes
   `/get_rollout_data` sends for it, and the CPU of encoding, storing and delivering it (`RolloutBuffer.write`,
   `deliver`) against the same record without routed experts.
2. Paired over HTTP: two buffers at once, each a math run of `--items` groups of 8 against one simulated MoE engine
   (`--layers` × `--top-k`), the candidate asking for routed experts and top-p kept ids, the baseline not (or
   neither: `--aa`, the pair's own spread); their CPU per sample and its ratio, `--rounds` times.

    python -m bench.replay_cost                 # both parts
    python -m bench.replay_cost --aa            # the paired part with both buffers asking for nothing
    python -m bench.replay_cost --quick
The buffer's CPU per proxied turn with routing replay on: `python -m bench.proxy_pair
--engine-flag=--enable-return-routed-experts --engine-flag=--moe-layers=48 --engine-flag=--moe-top-k=8
--candidate-option return_routed_experts=true` (and without the candidate option for its A/A spread).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console

from bench.harness import Meter, Service, rollout_buffer, sim_engine
from bench.store_write import _bench_run
from bench.workload import start_payload, write_tasks
from rollout_buffer.delivery.encoded import EncodedRecord
from rollout_buffer.schemas import TrajectoryRecord

console = Console(width=160)


def long_record(tokens: int, layers: int, top_k: int, routed: bool) -> TrajectoryRecord:
    """A trajectory of `tokens` tokens (the last quarter the response), with its routed experts when `routed`."""
    rng = np.random.default_rng(0)
    response = tokens // 4
    fields: dict[str, Any] = {
        "uid": f"long-{routed}", "instance_id": "long", "reward": 1.0, "extra_info": {"epoch": 0},
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
        "tokens": rng.integers(0, 151_000, tokens).tolist(), "loss_mask": [0] * (tokens - response) + [1] * response,
        "rollout_log_probs": (-rng.random(response)).tolist(), "response_length": response,
    }
    if routed:  # expert ids of a 128-expert model
        fields["rollout_routed_experts"] = rng.integers(0, 128, (tokens - 1) * layers * top_k).astype("<i4").tobytes()
    return TrajectoryRecord.model_validate(fields)


async def _store_and_deliver(workdir: Path, record: TrajectoryRecord) -> dict[str, float]:
    async with _bench_run(workdir, 1) as (buffer, run):
        cpu, wall = time.process_time(), time.perf_counter()
        encoded = EncodedRecord.of(record)
        encode_ms = (time.process_time() - cpu) * 1000
        cpu = time.process_time()
        await buffer.write_encoded([encoded], run)
        store_ms = (time.process_time() - cpu) * 1000
        cpu = time.process_time()
        delivered = await buffer.deliver(1, 0.0, None)
        sent = sum(len(r.blob) for r in delivered.records)
        deliver_ms = (time.process_time() - cpu) * 1000
        return {"json": len(encoded.row.blob), "side": len(encoded.row.side or b""), "sent": sent,
                "encode_ms": encode_ms, "store_ms": store_ms, "deliver_ms": deliver_ms,
                "wall_s": time.perf_counter() - wall}


def storage_part(workdir: Path, tokens: int, layers: int, top_k: int) -> str:
    """Part 1: one long trajectory's side data, bytes and CPU, with and without routed experts; its summary."""
    off = asyncio.run(_store_and_deliver(workdir / "off", long_record(tokens, layers, top_k, False)))
    on = asyncio.run(_store_and_deliver(workdir / "on", long_record(tokens, layers, top_k, True)))
    raw = (tokens - 1) * layers * top_k * 4
    console.print(f"{tokens}-token trajectory, {layers} layers x top-{top_k}: {raw / 1e6:.1f} MB of int32 routed "
                  f"experts ({(tokens - 1) * layers * top_k / 1e6:.1f} M values)")
    for name, r in (("without routed experts", off), ("with routed experts", on)):
        console.print(f"  {name}: JSON {r['json'] / 1e6:.2f} MB, side data {r['side'] / 1e6:.2f} MB, sent "
                      f"{r['sent'] / 1e6:.2f} MB; CPU ms encode {r['encode_ms']:.0f}, store {r['store_ms']:.0f}, "
                      f"deliver {r['deliver_ms']:.0f}")
    return (f"side data {on['side'] / raw:.4f}x the raw int32 size, {(on['sent'] - off['sent']) / tokens:.0f} more "
            f"bytes per token delivered (base64), encode + store + deliver "
            f"{on['encode_ms'] + on['store_ms'] + on['deliver_ms']:.0f} ms CPU against "
            f"{off['encode_ms'] + off['store_ms'] + off['deliver_ms']:.0f} ms without")


async def _pair_round(engine: Service, buffers: list[Service], options: list[dict[str, Any]], workdir: Path,
                      items: int, k: int) -> list[float]:
    """Each buffer's CPU ms per sample over one math run of `items` groups, both runs at once."""
    tasks = write_tasks(workdir / f"tasks-{k}.jsonl", items)
    with contextlib.ExitStack() as stack:
        meters = [stack.enter_context(Meter(b.pid, children=False)) for b in buffers]
        async with httpx.AsyncClient(timeout=60) as http:
            for buffer, extra in zip(buffers, options, strict=True):
                payload = {**start_payload(tasks, engine.url, 256, "token"), **extra}
                (await http.post(f"{buffer.url}/start_rollout", json=payload)).raise_for_status()
            done: dict[int, float] = {}
            while len(done) < len(buffers):
                for i, buffer in enumerate(buffers):
                    run = (await http.get(f"{buffer.url}/status")).json()["run"]
                    if i not in done and run["state"] != "running":
                        if run["progress"]["failed"]:
                            raise SystemExit(f"buffer {i}: {run['progress']['failures']}")
                        done[i] = meters[i].usage().cpu_s * 1000 / run["progress"]["done"]
                await asyncio.sleep(0.2)
    return [done[i] for i in range(len(buffers))]


def paired_part(workdir: Path, items: int, rounds: int, layers: int, top_k: int, aa: bool) -> str:
    """Part 2: CPU per sample of a buffer asking for routed experts and top-p ids against one asking for none; its
    summary."""
    asked = {} if aa else {"return_routed_experts": True,
                           "sampling_params": {"temperature": 1.0, "top_p": 0.95}}
    flags = ["--enable-return-routed-experts", f"--moe-layers={layers}", f"--moe-top-k={top_k}", "--top-p-replay"]
    ratios = []
    with sim_engine(workdir, 20.0, 0, *flags) as engine, rollout_buffer(workdir) as base, \
            rollout_buffer(workdir) as cand:
        for k in range(rounds):
            base_ms, cand_ms = asyncio.run(_pair_round(engine, [base, cand], [{}, asked], workdir, items, k))
            ratios.append(cand_ms / base_ms)
            console.print(f"round {k + 1}: baseline {base_ms:.3f} ms/sample | candidate {cand_ms:.3f} ms/sample | "
                          f"candidate/baseline {ratios[-1]:.3f}")
    what = "A/A (neither asks)" if aa else f"routing ({layers}x{top_k}) and top-p replay on / off"
    return (f"CPU per sample, {what}: {sum(ratios) / len(ratios):.3f} "
            f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--items", type=int, default=64, help="groups of 8 per buffer and round (part 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--aa", action="store_true", help="part 2 only, with neither buffer asking")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.items, args.rounds = 8192, 16, 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-replay-"))
    workdir.mkdir(parents=True, exist_ok=True)
    parts = [] if args.aa else [storage_part(workdir, args.tokens, args.layers, args.top_k)]
    parts.append(paired_part(workdir, args.items, args.rounds, args.layers, args.top_k, args.aa))
    console.print(f"SUMMARY replay cost: {'; '.join(parts)}", soft_wrap=True)


if __name__ == "__main__":
    main()
