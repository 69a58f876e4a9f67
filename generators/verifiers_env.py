"""Task type `verifiers`: environments written for PrimeIntellect's verifiers (`verifiers.v1`) train unchanged.

The environment runs in its own interpreter (`env_python`, a venv with verifiers and the environment installed):
a pool of worker processes loads it once (`rollout_buffer/environments/verifiers_worker.py`). Per row, a session
opens here, a worker runs the environment's episode with the session as its policy endpoint (so the tokens are
captured exactly, whatever the environment's harness sends), and the session closes with the reward the
environment computed; its per-function rewards and metrics go to `extra_info.env`.

Without `input_file` the environment's own taskset is the input: listed once at start into a file under the
server's data folder, instance ids from the tasks' ids (else their content keys), stable across restarts. The
worker that listed it, the environment loaded, becomes the first of the run's pool when the run's trajectories
run in this process (not on Ray actors, which keep their own pools): the run adopts it instead of loading the
environment again; one no run adopted within `_PARK_S` (a start that failed after the listing) is stopped.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import shutil
import subprocess
from pathlib import Path
from typing import Annotated, Any, ClassVar

import orjson
from pydantic import Field, model_validator

from rollout_buffer.generator_api import (
    EnvError,
    EnvLoadError,
    EnvWorker,
    EnvWorkerDied,
    Governed,
    Policy,
    ProcessPool,
    RolloutContext,
    RunOptions,
    Trajectory,
    WorkerSpec,
    fate_shared,
    give_to,
    python_env_paths,
    scratch_folder,
    user_ids,
    venv_python,
    worker_script,
)

TASK_TYPE = "verifiers"
REQUIRED_FIELDS = ("env_task",)

_SHARED_KEY = "verifiers.pool"
_LIST_TIMEOUT_S = 600.0
_PARK_S = 60.0  # how long the pool that listed a taskset waits for its run

log = logging.getLogger(__name__)

__all__ = ["TASK_TYPE", "check_payload", "default_input", "run_rollout", "runs_in_buffer"]


class VerifiersOptions(RunOptions):
    """How a `verifiers` run loads and runs its environment (docs: "Bring your environment")."""

    error_prefix: ClassVar[str] = "verifiers run options"

    env_python: Annotated[str | None, Governed("program")] = Field(
        default=None, min_length=1, description="the interpreter of a venv with verifiers and the environment")
    env_requirements: Annotated[list[str] | None, Governed("packages")] = Field(
        default=None, min_length=1, description="pip requirements of a venv the buffer makes")
    env_id: str = Field(min_length=1, description="the taskset id as verifiers imports it")
    env_args: dict[str, Any] = Field(default_factory=dict, description="the taskset's config fields")
    env_config: dict[str, Any] = Field(default_factory=dict, description="the rest of verifiers' env config")
    env_paths: Annotated[list[str], Governed("code_paths")] = Field(
        default_factory=list, description="folders the worker imports environments from")
    env_workers: int = Field(default=1, ge=1, le=256)
    env_max_episodes: int = Field(default=16, ge=1, description="episodes one worker runs at once")
    env_timeout_s: float = Field(default=1800.0, gt=0, description="time limit of one episode")
    env_max_retries: int = Field(default=2, ge=0, description="retries of an episode whose worker died")
    env_start_timeout_s: float = Field(default=600.0, gt=0)
    env_user: Annotated[str | None, Governed("user")] = Field(default=None, min_length=1,
                                                              description="the user the workers run as")

    @model_validator(mode="after")
    def _one_interpreter(self) -> VerifiersOptions:
        if (self.env_python is None) == (self.env_requirements is None):
            raise ValueError("env_python: give env_python or env_requirements (exactly one)")
        return self

    def interpreter(self) -> str:
        """`env_python`, or the venv made from `env_requirements` (blocking the first time: call it in a thread)."""
        if self.env_python is not None:
            return self.env_python
        assert self.env_requirements is not None
        return venv_python(self.env_requirements, "env_requirements")

    def load_config(self) -> dict[str, Any]:
        """The env config verifiers resolves: `env_config`, its taskset named by `env_id` with `env_args`."""
        taskset = {**self.env_config.get("taskset", {}), **self.env_args, "id": self.env_id}
        return {**self.env_config, "taskset": taskset}

    def user(self) -> tuple[int, int] | None:
        """(uid, gid) of `env_user` when the workers run as another user than the buffer's."""
        return user_ids(self.env_user, "env_user") if self.env_user is not None else None

    def spec(self, python: str, cwd: Path | None = None) -> WorkerSpec:
        """How this run's workers start, with the environment's interpreter `python`."""
        return WorkerSpec(python, worker_script("verifiers"), self.load_config(), python_env_paths(self.env_paths),
                          cwd, self.env_start_timeout_s, f"verifiers:{self.env_id}", self.user())


def runs_in_buffer(payload: dict[str, Any]) -> bool:
    """Episodes run where the server's executor runs trajectories: with `--executor ray` each Ray actor keeps its
    own pool of environment workers on its node (`env_workers` per actor), its episodes' sessions opened through
    the buffer (on its session workers when it has them)."""
    return False


def check_payload(payload: dict[str, Any], policy: Policy) -> None:
    """The start-time checks (blocking: called in a thread; the server's policy has allowed the interpreter, the
    requirements and the paths already): the options, and an interpreter that exists."""
    opts = VerifiersOptions.from_run(payload)
    python = opts.interpreter()  # the first time with env_requirements: the venv is made here
    if shutil.which(python) is None:
        raise ValueError(f"env_python: {python!r} is not an executable interpreter")
    for path in opts.env_paths:
        if not Path(path).is_dir():
            raise ValueError(f"env_paths: {path} is not a folder")
    ids = opts.user()
    if ids is not None:  # the user must be able to run the interpreter and import verifiers from it
        probe = subprocess.run(fate_shared([python, "-c", "import verifiers.v1"], ids), cwd="/", capture_output=True,
                               timeout=_LIST_TIMEOUT_S, check=False)
        if probe.returncode != 0:
            raise ValueError(f"env_user: {opts.env_user!r} cannot run {python} and import verifiers: "
                             f"{probe.stderr.decode(errors='replace')[-800:]}")


async def default_input(payload: dict[str, Any], runs_here: bool) -> list[dict[str, Any]]:
    """The environment's own taskset as input rows, listed by the first worker of the run's pool, kept for the run
    when it `runs_here` (its trajectories in this process: see the module docstring), else stopped.

    ValueError naming the option when the environment cannot be loaded.
    """
    opts = VerifiersOptions.from_run(payload)
    python = await asyncio.to_thread(opts.interpreter)
    pool = await _Pool.start(opts, python)
    try:
        async with pool.lease() as worker:
            listed = (await worker.request({"op": "tasks"}, _LIST_TIMEOUT_S)).get("tasks")
        rows = _rows(opts, listed)
    except BaseException as e:
        await pool.aclose()
        if isinstance(e, EnvLoadError):
            raise ValueError(f"{e.field}: {opts.env_id!r} cannot be loaded by {python}: {e}") from None
        if isinstance(e, EnvError):
            raise ValueError(f"env_python: {python} did not run the verifiers worker: {e}") from None
        raise
    if runs_here:
        _parked.park(_pool_key(opts, python), pool)
    else:
        await pool.aclose()
    return rows


def _rows(opts: VerifiersOptions, listed: Any) -> list[dict[str, Any]]:
    if not isinstance(listed, list):
        raise ValueError(f"env_python: the verifiers worker listed no tasks (answered {listed!r})")
    rows = []
    for task in listed:
        iid = task["id"] if task.get("id") else f"{opts.env_id}-{task['key'][:16]}"
        rows.append({"instance_id": iid, "env_task": {"idx": task["idx"], "key": task["key"]},
                     "prompt": task.get("prompt") or ""})
    if not rows:
        raise ValueError(f"env_id: {opts.env_id!r} has no tasks")
    return rows


class _Pool(ProcessPool[EnvWorker]):
    """The run's workers with their scratch folder, removed when the run ends."""

    def __init__(self, opts: VerifiersOptions, python: str, scratch: Path):
        self.scratch = scratch
        spec = opts.spec(python, self.scratch)
        give_to(self.scratch, spec.user)
        super().__init__(lambda index: EnvWorker(spec, index), opts.env_workers, opts.env_max_episodes, spec.name)

    @classmethod
    async def start(cls, opts: VerifiersOptions, python: str) -> _Pool:
        """A pool for the run, its scratch folder made off the event loop."""
        return cls(opts, python, await asyncio.to_thread(scratch_folder, "rb-env-"))

    async def aclose(self) -> None:
        await super().aclose()
        await asyncio.to_thread(shutil.rmtree, self.scratch, True)


def _pool_key(opts: VerifiersOptions, python: str) -> bytes:
    return orjson.dumps([python, opts.model_dump(mode="json")], option=orjson.OPT_SORT_KEYS)


class _Parked:
    """Pools that listed a taskset, by their options, each until its run adopts it or `_PARK_S` passed."""

    def __init__(self) -> None:
        self._pools: dict[bytes, tuple[_Pool, asyncio.TimerHandle]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        # A server stopped while a pool waits: its workers die with the process (fate-shared), its folder here.
        atexit.register(self._remove_scratch)

    def park(self, key: bytes, pool: _Pool) -> None:
        """Keep `pool` for the run started with these options (one listed before with them is stopped)."""
        self._stop(key)
        self._pools[key] = (pool, asyncio.get_running_loop().call_later(_PARK_S, self._stop, key))

    def adopt(self, key: bytes) -> _Pool | None:
        """The pool parked with these options, now the caller's."""
        parked = self._pools.pop(key, None)
        if parked is None:
            return None
        parked[1].cancel()
        return parked[0]

    def _stop(self, key: bytes) -> None:
        parked = self._pools.pop(key, None)
        if parked is None:
            return
        parked[1].cancel()
        task = asyncio.get_running_loop().create_task(parked[0].aclose(), name="stop a listing's verifiers pool")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _remove_scratch(self) -> None:
        for pool, _ in self._pools.values():
            shutil.rmtree(pool.scratch, ignore_errors=True)


_parked = _Parked()


async def _pool(ctx: RolloutContext) -> tuple[_Pool, VerifiersOptions]:
    opts = ctx.options(VerifiersOptions)

    async def build() -> _Pool:
        python = await asyncio.to_thread(opts.interpreter)
        adopted = _parked.adopt(_pool_key(opts, python))
        if adopted is not None:
            log.info("verifiers:%s: the run goes on with the worker that listed its tasks", opts.env_id)
            return adopted
        return await _Pool.start(opts, python)

    return await ctx.run.once(_SHARED_KEY, build), opts


async def run_rollout(item: dict[str, Any], ctx: RolloutContext) -> list[Trajectory]:
    """One episode of the row's task through a fresh session; its records carry the environment's reward."""
    pool, opts = await _pool(ctx)
    task = item.get("env_task")
    if not isinstance(task, dict) or not isinstance(task.get("idx"), int):
        raise EnvError("env_task", "the row's env_task must be {\"idx\": int, \"key\": str} (as listed)")
    attempt = 0
    while True:
        session = await ctx.open_session({"instance_id": ctx.instance_id})
        try:
            async with pool.lease() as worker:
                result = await worker.request({"op": "episode", "idx": task["idx"], "key": task.get("key"),
                                               "base_url": session.base_url, "api_key": session.api_key,
                                               "model": ctx.config.get("model_name") or "policy"}, opts.env_timeout_s)
        except EnvWorkerDied as e:
            await session.discard(str(e))
            attempt += 1
            if attempt > opts.env_max_retries:
                raise EnvError("env_worker_crash", f"{e} (episode tried {attempt} times, env_max_retries="
                                     f"{opts.env_max_retries})") from None
            continue
        except BaseException as e:
            await session.discard(f"{type(e).__name__}: {e}")
            raise
        return await _records(session, result, attempt)


async def _records(session: Any, result: dict[str, Any], retries: int) -> list[Trajectory]:
    traces = result.get("traces") or []
    info = {"env": {"ok": result.get("ok"), "traces": traces, "errors": result.get("errors") or [],
                    "retries": retries}}
    if result.get("is_timeout"):
        await session.discard("the environment's own episode time limit passed")
        raise EnvError("env_timeout", f"the episode exceeded the environment's time limit: "
                             f"{_errors(result)}")
    if not result.get("ok"):
        await session.discard(_errors(result))
        raise EnvError("env_error", f"the environment's episode failed: {_errors(result)}")
    scored = [t for t in traces if t.get("trainable", True)] or traces
    given = [t.get("reward") if t.get("rewards") else None for t in scored]  # no reward function ran: none
    rewards = [float(r) for r in given if isinstance(r, (int, float))]
    if not rewards or len(rewards) < len(given):
        await session.discard("the environment gave no reward")
        raise EnvError("env_reward", f"the environment gave no reward (no reward function or judge ran; "
                       f"traces: {len(traces)}, rewards: {given})")
    try:
        records = await session.close(sum(rewards) / len(rewards), **info)
    except ValueError as e:
        raise EnvError("env_no_turns", f"{e}; the environment's episode asked the model nothing") from None
    return per_trace(records, traces)


def per_trace(records: list[Trajectory], traces: list[dict[str, Any]]) -> list[Trajectory]:
    """Each record with its own trace's reward: verifiers sends every agent run's requests under the run's trace id
    (`X-Session-ID`), which the session keeps as its branch's lane. An episode of several runs scored against
    each other (best-of-n, relative judges) so gives each run its reward as the environment gave it; runs the
    environment marks untrainable (a modeled user, a judge seat) leave no record; with several seats, a record's
    `agent_id` is its seat, for role streams."""
    by_id = {t.get("id"): t for t in traces}
    seats = {t.get("agent") for t in traces if t.get("trainable", True)}
    kept = []
    for record in records:
        trace = by_id.get(record["extra_info"].get("lane"))
        if trace is None:
            if len(traces) == 1:
                record["extra_info"]["metrics"] = trace_metrics(traces[0])
            kept.append(record)
            continue
        if not trace.get("trainable", True):
            continue
        record["reward"] = float(trace["reward"])
        record["extra_info"]["env_trace"] = trace["id"]
        record["extra_info"]["metrics"] = trace_metrics(trace)
        if len(seats) > 1:
            record["extra_info"]["agent_id"] = trace.get("agent")
        kept.append(record)
    return kept


def _errors(result: dict[str, Any]) -> str:
    errors = list(result.get("errors") or [])
    for trace in result.get("traces") or []:
        errors += trace.get("errors") or []
    return "; ".join(f"{e.get('type')}: {e.get('message')}" for e in errors)[:2000] or "no error given"


def trace_metrics(trace: dict[str, Any]) -> dict[str, float]:
    """A trace's reward functions' scores and its metrics, by name (the dashboard shows their means)."""
    scores = {name: r["score"] for name, r in (trace.get("rewards") or {}).items() if r is not None}
    return {**scores, **{k: v for k, v in (trace.get("metrics") or {}).items() if v is not None}}
