"""One row of an agent run: open a session, run the agent against it, score, close the session into records."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from generators.agent.loading import accepted, call, check_reference
from generators.agent.options import AgentOptions
from generators.agent.sandbox import (
    AgentFailed,
    AgentProcess,
    DockerSandbox,
    LocalSandbox,
    ProcessOutcome,
    Sandbox,
    Workspace,
    agent_user,
    current_user,
)
from generators.math import final_answer_text
from generators.scoring import answer_reward
from rollout_buffer.generator_api import AgentSession, RolloutContext, Trajectory

log = logging.getLogger(__name__)

_SHARED_KEY = "agent"
RESULT_FILE = "result.json"
_OUTPUT_IN_RECORD = 2000  # characters of stdout / stderr kept in extra_info


@dataclass
class AgentRun:
    """What the rows of one run share: options, the loaded functions, the sandbox, the threads of sync agents."""

    options: AgentOptions
    agent: Any = None
    scorer: Any = None
    sandbox: Sandbox | None = None
    threads: ThreadPoolExecutor | None = None
    running: asyncio.Semaphore | None = None  # `agent_max_running` in this process (the buffer, or a Ray actor)

    async def aclose(self) -> None:
        """The run ended (the runner calls this): agents still running in threads are left to end alone."""
        if self.threads is not None:
            self.threads.shutdown(wait=False, cancel_futures=True)


@dataclass
class Outcome:
    """What one agent run produced: its own reward or answer, and how it ended."""

    reward: float | None = None
    answer: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    process: ProcessOutcome | None = None


async def agent_run(ctx: RolloutContext) -> AgentRun:
    """The run's shared state, built once by its first rows (imports go to a thread): rows arriving together would
    otherwise import the agent's file at once in several threads, and one could see the module another is still
    executing (without its function yet)."""
    return await ctx.run.once(_SHARED_KEY, lambda: _build_agent_run(ctx))


async def _build_agent_run(ctx: RolloutContext) -> AgentRun:
    """Load the run's agent and scorer, make its threads and sandbox (kept in `ctx.run.shared`)."""
    opts = ctx.options(AgentOptions)
    shared = AgentRun(opts)
    if opts.agent_max_running is not None:
        shared.running = asyncio.Semaphore(opts.agent_max_running)
    if opts.agent is not None:
        shared.agent = await asyncio.to_thread(check_reference, opts.agent, "agent")
        workers = int(ctx.config.get("num_process") or 256)
        shared.threads = ThreadPoolExecutor(max_workers=min(workers, 1024), thread_name_prefix="agent")
    if opts.hook_scorer:
        shared.scorer = await asyncio.to_thread(check_reference, opts.scorer, "scorer")
    if opts.agent_command is not None:
        user = agent_user(opts.agent_user)
        shared.sandbox = (DockerSandbox(user, opts.agent_image or "") if opts.agent_sandbox == "docker"
                          else LocalSandbox(user))
    return shared


async def run_agent(item: dict[str, Any], ctx: RolloutContext) -> list[Trajectory]:
    """Run the row's agent through a fresh session; the session's records (one per branch) with the reward."""
    run = await agent_run(ctx)
    opts = run.options
    if not opts.runs_agents:
        raise AgentFailed("agent_config", "this agent run has neither agent nor agent_command")
    if run.running is None:
        return await _run_in_session(run, item, ctx)
    async with run.running:  # taken before the session opens: a waiting row holds no session
        return await _run_in_session(run, item, ctx)


async def _run_in_session(run: AgentRun, item: dict[str, Any], ctx: RolloutContext) -> list[Trajectory]:
    opts = run.options
    session = await ctx.open_session({"instance_id": ctx.instance_id})
    user = agent_user(opts.agent_user) if run.sandbox is not None else current_user()
    try:
        async with Workspace(orjson.dumps(item), user, opts.agent_workdir_root) as ws:
            if run.sandbox is not None:
                outcome = await _run_command(run, item, session, ws)
            else:
                outcome = await _run_callable(run, item, session, ws)
            reward, scoring = await _reward(run, item, session, ws, outcome)
    except BaseException as e:
        await session.discard(f"{type(e).__name__}: {e}")
        raise
    try:
        return await session.close(reward, **outcome.info, **scoring)
    except ValueError as e:  # the agent never asked the model anything
        raise AgentFailed("agent_no_turns", f"{e}; the agent made no model request") from None


async def _run_callable(run: AgentRun, item: dict[str, Any], session: AgentSession, ws: Workspace) -> Outcome:
    offered = {"workdir": str(ws.work), "anthropic_base_url": session.anthropic_base_url,
               "session_id": session.session_id}
    kwargs = accepted(run.agent, offered)
    try:
        result = await asyncio.wait_for(
            call(run.agent, item, session.base_url, session.api_key, executor=run.threads, **kwargs),
            run.options.agent_timeout_s)
    except TimeoutError:
        raise AgentFailed("agent_timeout", f"the agent did not return within agent_timeout_s="
                          f"{run.options.agent_timeout_s:g}") from None
    except AgentFailed:
        raise
    except Exception as e:
        raise AgentFailed("agent_error", f"the agent raised {type(e).__name__}: {e}") from e
    return _interpret(result, "the agent returned")


def _interpret(result: Any, what: str) -> Outcome:
    """An agent's result: a number is its reward, a string its answer, a dict may hold both; None is neither."""
    if result is None:
        return Outcome()
    if isinstance(result, (int, float)):
        return Outcome(reward=float(result))
    if isinstance(result, str):
        return Outcome(answer=result)
    if isinstance(result, dict) and set(result) <= {"reward", "answer"}:
        reward, answer = result.get("reward"), result.get("answer")
        if (reward is None or isinstance(reward, (int, float))) and (answer is None or isinstance(answer, str)):
            return Outcome(reward=None if reward is None else float(reward), answer=answer)
    raise AgentFailed("agent_result", f"{what} {type(result).__name__}; expected a reward (number), an answer "
                      "(string), {\"reward\", \"answer\"} or None")


async def _run_command(run: AgentRun, item: dict[str, Any], session: AgentSession, ws: Workspace) -> Outcome:
    opts = run.options
    assert opts.agent_command is not None and run.sandbox is not None
    env = {
        **opts.agent_env,
        "OPENAI_BASE_URL": session.base_url, "OPENAI_API_KEY": session.api_key,
        "ANTHROPIC_BASE_URL": session.anthropic_base_url, "ANTHROPIC_API_KEY": session.api_key,
        "ROLLOUT_SESSION_ID": session.session_id, "ROLLOUT_ITEM_FILE": str(ws.item_file),
        "ROLLOUT_RESULT_FILE": str(ws.work / RESULT_FILE),
    }
    base = session.base_url.split("/sessions/", 1)[0]
    proc = AgentProcess(opts.agent_command, env, orjson.dumps(item) + b"\n", ws, opts.agent_timeout_s,
                        opts.agent_max_output_bytes, opts.agent_network, session.agent_socket, base)
    done = await run.sandbox.run(proc)
    info = {"agent": {"exit_code": done.exit_code, "duration_s": round(done.duration_s, 3), "network": done.network,
                      "user": done.user, "output_truncated": done.output_truncated,
                      "stderr_tail": done.stderr[-_OUTPUT_IN_RECORD:]}}
    if done.timed_out:
        raise AgentFailed("agent_timeout", f"the agent command did not end within agent_timeout_s="
                          f"{opts.agent_timeout_s:g} and was killed; stderr: {done.stderr[-500:].strip()!r}", info)
    if done.exit_code != 0:
        raise AgentFailed("agent_exited", f"the agent command exited with code {done.exit_code}; stderr: "
                          f"{done.stderr[-500:].strip()!r}", info)
    outcome = await asyncio.to_thread(_result_file, ws.work / RESULT_FILE)
    if outcome is None:
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        outcome = Outcome(answer=lines[-1].strip() if lines else None)
    outcome.info, outcome.process = info, done
    return outcome


def _result_file(path: Path) -> Outcome | None:
    if not path.is_file():
        return None
    try:
        return _interpret(orjson.loads(path.read_bytes()), f"{RESULT_FILE} holds")
    except orjson.JSONDecodeError as e:
        raise AgentFailed("agent_result", f"{RESULT_FILE} is not valid JSON: {e}") from None


async def _reward(run: AgentRun, item: dict[str, Any], session: AgentSession, ws: Workspace, outcome: Outcome
                  ) -> tuple[float, dict[str, Any]]:
    """(reward, what extra_info records about it): the agent's own reward, else the run's scorer."""
    if outcome.reward is not None:
        return outcome.reward, {"scorer": "agent"}
    transcript = await session.transcript()
    answer = outcome.answer
    if answer is None:
        last = next((m for m in reversed(transcript) if m.get("role") == "assistant"), None)
        answer = final_answer_text(last["content"]) if last is not None else None
    opts = run.options
    if run.scorer is not None:
        record = {"answer": answer, "messages": transcript,
                  "stdout": outcome.process.stdout if outcome.process else None,
                  "stderr": outcome.process.stderr if outcome.process else None,
                  "exit_code": outcome.process.exit_code if outcome.process else None}
        try:
            value = await asyncio.wait_for(call(run.scorer, item, str(ws.work), record), opts.reward_timeout_s)
            return float(value), {"scorer": opts.scorer, "answer": answer}
        except TimeoutError:
            raise AgentFailed("scorer_timeout", f"the scorer took over reward_timeout_s={opts.reward_timeout_s:g}"
                              ) from None
        except Exception as e:  # the user's hook: any failure is the trajectory's, named
            raise AgentFailed("scorer_error", f"the scorer failed: {type(e).__name__}: {e}") from None
    try:
        reward, scorer, reference = await answer_reward(answer, item, opts.scorer, opts.reward_timeout_s)  # type: ignore[arg-type]
    except ValueError as e:
        raise AgentFailed("scorer_error", f"no reward: the agent gave none and {e}") from None
    return reward, {"scorer": scorer, "answer": answer, **reference}
