"""`rollout-buffer demo`: a whole rollout on one machine, no GPU: sim engine → buffer → slime adapter."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # (host, port) of an AF_INET socket
        return port


def bundled_dataset(task: str) -> Path:
    """The small dataset shipped for a demo task (the agent demo's calculator agent takes the tool-call tasks)."""
    name = "tool_call" if task == "agent" else task
    return Path(str(resources.files("generators") / "data" / f"{name}_demo.jsonl"))


def bundled_agent() -> str:
    """The example agent the agent demo trains: the plain-`openai` calculator agent."""
    return f"{resources.files('generators') / 'data' / 'agents' / 'openai_agent.py'}:agent"


def _start_agent_run(buffer_url: str, engine_url: str, tokenizer: str, input_file: Path, ns: argparse.Namespace
                     ) -> None:
    """The agent demo's run, started before the adapter looks (it then finds it serving the same task and file):
    the slime adapter's payload has no field naming the agent."""
    payload = {"task_type": "agent", "input_file": str(input_file), "agent": ns.agent or bundled_agent(),
               "num_repeat_per_sample": ns.num_repeat, "num_epoch": ns.num_epoch, "num_process": ns.num_process,
               "remote_engine_url": engine_url, "tokenizer_path": tokenizer, "max_tokens": ns.max_tokens,
               "sampling_params": {"temperature": 0.8, "top_p": 1.0}}
    answer = httpx.post(f"{buffer_url}/start_rollout", json=payload, timeout=60)
    if answer.status_code != 200:
        raise RuntimeError(f"the agent run was refused: {answer.text}")


def _allowed(ns: argparse.Namespace, tokenizer: str, input_file: Path) -> list[str]:
    """The demo's server lets its own run read the demo's input and tokenizer and, for the agent demo, run its
    agent (docs/security.md): what the demo names, nothing else."""
    flags = ["--data-root", str(input_file.parent), "--data-root", tokenizer]
    if ns.task == "agent":
        module_part = (ns.agent or bundled_agent()).rpartition(":")[0]
        is_file = module_part.endswith(".py") or "/" in module_part
        flags += ["--allow-code", module_part] if is_file else ["--allow-module", module_part]
    return flags


@contextlib.contextmanager
def _subprocess(args: list[str], health_url: str, log_file: Path, timeout_s: float = 120) -> Iterator[None]:
    with open(log_file, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rollout_buffer.tools.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"`rollout-buffer {args[0]}` exited early; see {log_file}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health_url, timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"`rollout-buffer {args[0]}` did not come up in {timeout_s}s; see {log_file}")
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _start_retriever(stack: contextlib.ExitStack, workdir: Path, console: Console) -> None:
    """Serve the bundled search corpus and point the buffer started next at it (it inherits the variable)."""
    from generators.search import SEARCH_URL_ENV

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    console.print(f"[dim]starting retrieval server on {url}[/dim]")
    corpus = resources.files("generators") / "data" / "search_corpus.jsonl"
    stack.enter_context(_subprocess(
        ["retriever", "--port", str(port), "--corpus", str(corpus), "--index-dir", str(workdir / "index")],
        f"{url}/health", workdir / "retriever.log"))
    os.environ[SEARCH_URL_ENV] = f"{url}/retrieve"


@dataclass
class DemoResult:
    """What the demo measured."""

    groups: int
    samples: int
    mean_raw_reward: float
    response_tokens: int
    total_tokens: int
    seconds: float
    failed: int
    planned: int = 0  # groups the run was to deliver (items × epochs)
    dropped: dict[str, int] = field(default_factory=dict)  # groups dropped, by reason
    data_dir: Path | None = None  # where the store was kept, when it was

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0


def _slime_args(buffer_url: str, engine_url: str, tokenizer: str, input_file: Path, ns: argparse.Namespace
                ) -> argparse.Namespace:
    """The slime args the adapter reads, as slime's parser would produce them."""
    from slime_adapter import add_arguments

    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args([])
    host, port = engine_url.removeprefix("http://").removeprefix("https://").rstrip("/").rsplit(":", 1)
    args.agent_rollout_buffer_url = buffer_url
    args.sglang_router_ip, args.sglang_router_port = host, int(port)
    args.prompt_data = str(input_file)
    args.hf_checkpoint = tokenizer
    args.rollout_task_type = ns.task
    args.rollout_batch_size = ns.batch_groups
    args.n_samples_per_prompt = ns.num_repeat
    args.num_epoch = ns.num_epoch
    args.rollout_num_process = ns.num_process
    args.rollout_max_response_len = ns.max_tokens
    args.rollout_temperature = 0.8
    args.rollout_top_p = 1.0
    args.rollout_buffer_wait_s = 5.0
    args.rollout_buffer_lease_s = 120.0
    args.fetch_trajectory_retry_times = 5
    args.use_wandb = False
    return args


def run_demo(ns: argparse.Namespace, console: Console) -> DemoResult:
    """Start what is missing, run the rollout through the slime adapter, return the numbers."""
    from slime_adapter import generate_rollout
    from slime_adapter.client import RolloutBufferError
    from slime_adapter.data_buffer import DataBuffer

    tokenizer = ns.tokenizer or bundled_tokenizer_path()
    input_file = Path(ns.input) if ns.input else bundled_dataset(ns.task)
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollout-demo-")))
        engine_url = ns.engine_url
        if engine_url is None:
            port = _free_port()
            engine_url = f"http://127.0.0.1:{port}"
            with console.status(f"starting a simulated SGLang engine on {engine_url} (no GPU; it loads the "
                                f"tokenizer)"):
                stack.enter_context(_subprocess(
                    ["sim-engine", "--port", str(port), "--tokenizer", tokenizer, "--latency-ms", str(ns.latency_ms)],
                    f"{engine_url}/health", workdir / "sim_engine.log"))
            console.print(f"[dim]simulated SGLang engine on {engine_url}[/dim]")
        if ns.task == "search":
            _start_retriever(stack, workdir, console)
        bport = _free_port()
        buffer_url = f"http://127.0.0.1:{bport}"
        data_dir = Path(ns.data_dir) if ns.data_dir else workdir / "data"
        with console.status(f"starting the rollout buffer on {buffer_url}"):
            stack.enter_context(_subprocess(
                ["serve", "--port", str(bport), "--data-dir", str(data_dir), *_allowed(ns, tokenizer, input_file)],
                f"{buffer_url}/healthz", workdir / "buffer.log"))
        console.print(f"[dim]rollout buffer on {buffer_url} (dashboard {buffer_url}/ui; store in {data_dir}; "
                      f"logs in {workdir})[/dim]")
        if ns.task == "agent":
            with console.status("starting the agent run (the tokenizer loads)"):
                _start_agent_run(buffer_url, engine_url, tokenizer, input_file, ns)
        args = _slime_args(buffer_url, engine_url, tokenizer, input_file, ns)
        num_items = sum(1 for line in input_file.open() if line.strip())
        total_groups = num_items * ns.num_epoch
        data_buffer = DataBuffer(ns.num_repeat)
        groups: list[list[Any]] = []
        stopped = ""
        start = time.monotonic()
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            bar = progress.add_task(f"{ns.task} groups", total=total_groups)
            rollout_id = 0
            while len(groups) < total_groups:
                args.rollout_batch_size = min(ns.batch_groups, total_groups - len(groups))
                try:
                    batch = generate_rollout(args, rollout_id, data_buffer)
                except RolloutBufferError as e:
                    stopped = str(e)
                    break
                groups += batch
                rollout_id += 1
                progress.update(bar, completed=len(groups))
        seconds = time.monotonic() - start
        status = httpx.get(f"{buffer_url}/status", timeout=10).json()
        if stopped:
            dropped = status.get("filtered") or {}
            why = ", ".join(f"{n} {reason}" for reason, n in dropped.items()) or "none dropped"
            console.print(f"[yellow]stopping at {len(groups)} of {total_groups} groups: the run has no more "
                          f"({why}); --num-epoch or a larger --input gives more[/yellow]" if "no more groups" in stopped
                          else f"[yellow]stopping: {stopped}[/yellow]")
    samples = [s for g in groups for s in g]
    raw = [float((s.metadata or {}).get("raw_reward", s.reward)) for s in samples]
    return DemoResult(
        groups=len(groups),
        samples=len(samples),
        mean_raw_reward=sum(raw) / len(raw) if raw else 0.0,
        response_tokens=sum(int(s.response_length) for s in samples),
        total_tokens=sum(len(s.tokens) for s in samples),
        seconds=seconds,
        failed=int(status.get("records", {}).get("failed", 0)),
        planned=total_groups,
        dropped=dict(status.get("filtered") or {}),
        data_dir=Path(ns.data_dir) if ns.data_dir else None,
    )


def print_result(result: DemoResult, console: Console) -> None:
    """The closing summary table: what became of every group, the numbers, and where to go next."""
    table = Table(title="rollout-buffer demo")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("groups planned", str(result.planned))
    table.add_row("groups delivered", str(result.groups))
    for reason, n in sorted(result.dropped.items()):
        table.add_row(f"groups dropped: {reason}", str(n))
    left = result.planned - result.groups - sum(result.dropped.values())
    if left > 0:
        table.add_row("groups not delivered (stopped early)", str(left))
    table.add_row("samples", str(result.samples))
    table.add_row("mean reward (raw)", f"{result.mean_raw_reward:.3f}")
    table.add_row("response tokens", str(result.response_tokens))
    table.add_row("total tokens", str(result.total_tokens))
    table.add_row("failed trajectories", str(result.failed))
    table.add_row("wall time (s)", f"{result.seconds:.1f}")
    table.add_row("samples/s", f"{result.samples_per_s:.1f}")
    console.print(table)
    keep = (f"rollout-buffer serve --data-dir {result.data_dir}" if result.data_dir is not None
            else "rollout-buffer demo --data-dir ./demo-data && rollout-buffer serve --data-dir ./demo-data")
    console.print("next:\n"
                  f"  {keep}   # then open http://127.0.0.1:8889/ui: every trajectory, down to its tokens\n"
                  "  the five-minute tour with curl (README.md): the protocol slime speaks, request by request\n"
                  "  scripts/run-qwen3-4b.sh (docs/slime-launch.md): train Qwen3-4B with slime through the buffer")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `rollout-buffer demo`."""
    p = sub.add_parser(
        "demo", help="run a whole rollout locally on a simulated engine (no GPU)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  rollout-buffer demo\n"
        "  rollout-buffer demo --task search --num-repeat 8\n"
        "  rollout-buffer demo --task agent --agent my_agent.py:run   # your OpenAI-client agent, trained\n"
        "  rollout-buffer demo --engine-url http://ROUTER:30000 --tokenizer /models/Qwen3-4B",
    )
    p.add_argument("--task", default="math", choices=["math", "search", "tool_call", "plan_act", "agent"])
    p.add_argument("--agent", default=None,
                   help="--task agent: your agent, path/file.py:function (default: the bundled openai agent)")
    p.add_argument("--engine-url", default=None, help="a real SGLang router instead of the simulated engine")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the bundled Qwen3 tokenizer)")
    p.add_argument("--input", default=None, help="input JSONL (default: the bundled dataset)")
    p.add_argument("--num-repeat", type=int, default=4)
    p.add_argument("--num-epoch", type=int, default=1)
    p.add_argument("--num-process", type=int, default=64)
    p.add_argument("--batch-groups", type=int, default=8, help="groups per training step (rollout_batch_size)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--latency-ms", type=float, default=30.0, help="simulated engine latency per request")
    p.add_argument("--data-dir", default=None, help="keep the store here instead of a temp dir")
    p.add_argument("--log-level", default="WARNING")


# What a demo task runs that the plain install does not hold: (module, the extra that brings it).
_NEEDS = {"agent": ("openai", "agents")}


def missing_extra(task: str, own_agent: bool) -> str | None:
    """The one line to show before the demo starts when its task needs an extra that is not installed."""
    module, extra = _NEEDS.get(task, (None, None))
    if module is None or own_agent or importlib.util.find_spec(module) is not None:
        return None
    return (f"rollout-buffer demo --task {task} runs the bundled agent, which needs the `{module}` package: "
            f"pip install 'rollout-buffer[{extra}]' (in a checkout: pip install -e '.[{extra}]')")


def main(ns: argparse.Namespace) -> None:
    """Run the demo and print its table."""
    if (missing := missing_extra(ns.task, ns.agent is not None)) is not None:
        print(missing, file=sys.stderr)
        raise SystemExit(2)
    console = Console()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run_demo(ns, console)
    print_result(result, console)
    if result.groups == 0:
        raise SystemExit("the demo delivered no groups; see the logs above")
