"""Task type `openenv`: environments served by Meta / Hugging Face's OpenEnv train unchanged.

The environment runs in its own server (the user's, at `openenv_url`, or processes the buffer starts from
`openenv_command`, in their own venv); the buffer speaks OpenEnv's WebSocket protocol to it
(`rollout_buffer/environments/openenv_client.py`) and drives a chat loop through a session: the observation is the
user message, the policy's reply the action, `step` answers with the next observation, a reward and done. An
environment whose actions are MCP tool calls has its tools offered to the policy; each call is a step and its
result the tool message. The record's reward is the episode's return (the sum of the step rewards, each kept in
`extra_info.openenv.step_rewards`).

Input rows give `reset` (the keyword arguments of the environment's `reset`: a seed, a task id); without
`input_file`, `openenv_resets` lists them.

Episodes run where the server's executor runs trajectories: with `--executor ray`, each Ray actor starts its own
servers on its node (`openenv_servers` and `openenv_max_sessions` are per actor), and its episodes' sessions are
opened through the buffer (on a session worker of the actor's node when there is one).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar

import httpx
import orjson
from pydantic import Field, model_validator

from rollout_buffer.generator_api import (
    PORT_PLACEHOLDER,
    AgentSession,
    EnvError,
    Governed,
    OpenEnvServer,
    OpenEnvSession,
    Policy,
    ProcessPool,
    RolloutContext,
    RunOptions,
    ServerSpec,
    StepResult,
    Trajectory,
    give_to,
    is_mcp,
    scratch_folder,
    user_ids,
    venv_python,
)

TASK_TYPE = "openenv"
REQUIRED_FIELDS = ()

_SHARED_KEY = "openenv.run"
PYTHON_PLACEHOLDER = "{python}"
_TEXT_FIELDS = ("prompt", "text", "message", "question", "content", "observation")
# Failures that mean the server went away under the episode: run it again on a live one.
_RETRIED = {"openenv_gone", "openenv_down", "openenv_capacity"}

__all__ = ["TASK_TYPE", "check_payload", "default_input", "run_rollout"]


def _one_default_reset() -> list[dict[str, Any]]:
    return [{}]


class OpenEnvOptions(RunOptions):
    """How an `openenv` run reaches its environment and talks to it (docs: "Bring your environment")."""

    error_prefix: ClassVar[str] = "openenv run options"

    openenv_url: Annotated[str | None, Governed("urls")] = Field(default=None, min_length=1,
                                                                 description="a running OpenEnv server")
    openenv_command: Annotated[list[str] | None, Governed("program")] = Field(
        default=None, min_length=1, description="starts one server; {port} is replaced by its port")
    openenv_requirements: Annotated[list[str] | None, Governed("packages")] = Field(
        default=None, min_length=1,
        description="pip requirements of a venv the buffer makes; {python} in the command is its interpreter")
    openenv_env: Annotated[dict[str, str], Governed("child_env")] = Field(
        default_factory=dict, description="environment variables of the command")
    openenv_servers: int = Field(default=1, ge=1, le=256, description="servers started from the command")
    openenv_max_sessions: int = Field(default=1, ge=1, description="episodes one server runs at once")
    openenv_resets: list[dict[str, Any]] = Field(default_factory=_one_default_reset, min_length=1)
    openenv_system_prompt: str | None = None
    openenv_prompt_field: str | None = Field(default=None, min_length=1,
                                             description="the observation field shown to the policy")
    openenv_image_field: str | None = Field(
        default=None, min_length=1,
        description="the observation field holding images shown with it (base64 or data URLs, one or a list)")
    openenv_action_field: str | None = Field(default=None, min_length=1,
                                             description="the action field the policy's reply fills")
    openenv_max_steps: int = Field(default=32, ge=1)
    openenv_timeout_s: float = Field(default=1800.0, gt=0, description="time limit of one episode")
    openenv_max_retries: int = Field(default=2, ge=0, description="retries of an episode whose server went away")
    openenv_start_timeout_s: float = Field(default=120.0, gt=0)
    openenv_user: Annotated[str | None, Governed("user")] = Field(default=None, min_length=1,
                                                                  description="the user started servers run as")

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvOptions:
        if (self.openenv_url is None) == (self.openenv_command is None):
            raise ValueError("openenv_url: give openenv_url or openenv_command (exactly one)")
        if self.openenv_command is not None and not any(PORT_PLACEHOLDER in a for a in self.openenv_command):
            raise ValueError(f"openenv_command: no {PORT_PLACEHOLDER} in it (where the server's port goes)")
        if self.openenv_requirements is not None and self.openenv_command is None:
            raise ValueError("openenv_requirements: only with openenv_command (its {python})")
        if self.openenv_user is not None and self.openenv_command is None:
            raise ValueError("openenv_user: only with openenv_command (the servers the buffer starts)")
        return self

    def user(self) -> tuple[int, int] | None:
        """(uid, gid) of `openenv_user` when started servers run as another user than the buffer's."""
        return user_ids(self.openenv_user, "openenv_user") if self.openenv_user is not None else None

    def command(self) -> list[str] | None:
        """`openenv_command`, `{python}` replaced by the interpreter of the venv made from `openenv_requirements`
        (blocking the first time: call it in a thread)."""
        if self.openenv_command is None or self.openenv_requirements is None:
            return self.openenv_command
        python = venv_python(self.openenv_requirements, "openenv_requirements")
        return [a.replace(PYTHON_PLACEHOLDER, python) for a in self.openenv_command]


def check_payload(payload: dict[str, Any], policy: Policy) -> None:
    """The start-time checks (blocking: called in a thread; the server's policy has allowed the program, the
    requirements and the URL already): the options, a reachable server or a program."""
    opts = OpenEnvOptions.from_run(payload)
    if opts.openenv_url is not None:
        try:
            httpx.get(opts.openenv_url.rstrip("/") + "/schema", timeout=10).raise_for_status()
        except httpx.HTTPError as e:
            raise ValueError(f"openenv_url: the OpenEnv server at {opts.openenv_url} does not answer /schema: {e}"
                             ) from None
    else:
        opts.user()
        command = opts.command()  # the first time with openenv_requirements: the venv is made here
        if command is not None and shutil.which(command[0]) is None:
            raise ValueError(f"openenv_command: program {command[0]!r} not found")


async def default_input(payload: dict[str, Any], runs_here: bool) -> list[dict[str, Any]]:
    """One row per `openenv_resets` entry, its instance id from its content (the same every time; where the run's
    trajectories run, `runs_here`, changes nothing)."""
    opts = OpenEnvOptions.from_run(payload)
    return [{"instance_id": f"openenv-{hashlib.sha256(orjson.dumps(r, option=orjson.OPT_SORT_KEYS)).hexdigest()[:12]}",
             "reset": r} for r in opts.openenv_resets]


class _Run(ProcessPool[OpenEnvServer]):
    """The run's servers, its HTTP client (schemas, the policy's session), its scratch folder."""

    def __init__(self, opts: OpenEnvOptions, command: list[str] | None, scratch: Path):
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30))
        self.scratch = scratch
        spec = ServerSpec(opts.openenv_url, command, opts.openenv_env, self.scratch, opts.openenv_start_timeout_s,
                          opts.user())
        give_to(self.scratch, spec.user)
        size = 1 if opts.openenv_url is not None else opts.openenv_servers
        super().__init__(lambda index: OpenEnvServer(spec, index, self.http), size, opts.openenv_max_sessions,
                         "OpenEnv server")

    async def aclose(self) -> None:
        await super().aclose()
        await self.http.aclose()
        await asyncio.to_thread(shutil.rmtree, self.scratch, True)


async def _run(ctx: RolloutContext) -> _Run:
    opts = ctx.options(OpenEnvOptions)

    async def build() -> _Run:
        command = await asyncio.to_thread(opts.command)
        return _Run(opts, command, await asyncio.to_thread(scratch_folder, "rb-openenv-"))

    return await ctx.run.once(_SHARED_KEY, build)


@dataclass
class Episode:
    """What an episode did, for the record."""

    step_rewards: list[float | None]
    done: bool = False
    end: str = "done"


async def run_rollout(item: dict[str, Any], ctx: RolloutContext) -> list[Trajectory]:
    """One episode of the row's `reset` through a fresh session; its records carry the episode's return."""
    run = await _run(ctx)
    opts = ctx.options(OpenEnvOptions)
    reset = item.get("reset", {})
    if not isinstance(reset, dict):
        raise EnvError("reset", "the row's reset must be a JSON object (the environment's reset arguments)")
    attempt = 0
    while True:
        session = await ctx.open_session({"instance_id": ctx.instance_id})
        try:
            async with run.lease() as server:
                try:
                    episode = await asyncio.wait_for(_episode(run.http, server, session, reset, opts),
                                                     opts.openenv_timeout_s)
                except EnvError as e:
                    if e.error_kind in _RETRIED:
                        await server.settle()  # a server that went away is not leased again
                    raise
        except TimeoutError:
            await session.discard("time limit")
            raise EnvError("env_timeout", f"the episode did not end within openenv_timeout_s="
                           f"{opts.openenv_timeout_s:g}") from None
        except EnvError as e:
            await session.discard(str(e))
            if e.error_kind not in _RETRIED:
                raise
            attempt += 1
            if attempt > opts.openenv_max_retries:
                raise EnvError(e.error_kind, f"{e} (episode tried {attempt} times, openenv_max_retries="
                               f"{opts.openenv_max_retries})") from None
            continue
        except BaseException as e:
            await session.discard(f"{type(e).__name__}: {e}")
            raise
        if episode.step_rewards and all(r is None for r in episode.step_rewards):
            await session.discard("no reward")
            raise EnvError("env_reward", f"the OpenEnv environment gave no reward in any of its "
                           f"{len(episode.step_rewards)} steps")
        reward = float(sum(r for r in episode.step_rewards if r is not None))
        info = {"openenv": {"step_rewards": episode.step_rewards, "steps": len(episode.step_rewards),
                            "done": episode.done, "end": episode.end, "retries": attempt, "reset": reset},
                "metrics": {"return": reward, "steps": len(episode.step_rewards), "done": float(episode.done)}}
        try:
            return await session.close(reward, **info)
        except ValueError as e:
            raise EnvError("env_no_turns", f"{e}; the episode asked the model nothing") from None


async def _episode(http: httpx.AsyncClient, server: OpenEnvServer, session: AgentSession, reset: dict[str, Any],
                   opts: OpenEnvOptions) -> Episode:
    mcp = is_mcp(server.schema)
    async with OpenEnvSession(server.url) as env:
        result = await env.reset(**reset)
        messages: list[dict[str, Any]] = []
        if opts.openenv_system_prompt:
            messages.append({"role": "system", "content": opts.openenv_system_prompt})
        messages.append(observation_message(result, opts))
        tools = await _tools(env) if mcp else None
        episode = Episode([])
        while not result.done:
            if len(episode.step_rewards) >= opts.openenv_max_steps:
                episode.end = "max_steps"
                return episode
            message, finish = await _policy(http, session, messages, tools)
            messages.append(message)
            if finish == "length":
                episode.end = "truncated"
                return episode
            if mcp:
                calls = message.get("tool_calls") or []
                if not calls:
                    episode.end = "no_tool_call"
                    return episode
                for call in calls:
                    result = await env.step(_tool_action(call))
                    episode.step_rewards.append(result.reward)
                    messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": tool_content(result)})
                    if result.done:
                        break
            else:
                result = await env.step(action_from(message.get("content") or "",
                                                    server.schema.get("action") or {}, opts.openenv_action_field))
                episode.step_rewards.append(result.reward)
                if not result.done:
                    messages.append(observation_message(result, opts))
        episode.done = True
        return episode


async def _policy(http: httpx.AsyncClient, session: AgentSession, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> tuple[dict[str, Any], str]:
    """The policy's next message through the session (which captures its tokens), and its finish reason."""
    body: dict[str, Any] = {"model": "policy", "messages": messages}
    if tools:
        body["tools"] = tools
    answer = await http.post(f"{session.base_url}/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {session.api_key}"})
    if answer.status_code != 200:
        raise EnvError("policy_error", f"the session answered {answer.status_code}: {answer.text[:500]}")
    choice = answer.json()["choices"][0]
    message = {k: v for k, v in choice["message"].items() if v is not None}
    return message, str(choice.get("finish_reason"))


async def _tools(env: OpenEnvSession) -> list[dict[str, Any]]:
    """The environment's MCP tools as OpenAI function tools."""
    listed = await env.step({"type": "list_tools"})
    tools = listed.observation.get("tools") or []
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                              "parameters": t.get("input_schema") or t.get("inputSchema")
                                              or {"type": "object", "properties": {}}}} for t in tools]


def _tool_action(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        arguments = {}
    return {"type": "call_tool", "tool_name": function.get("name") or "",
            "arguments": arguments if isinstance(arguments, dict) else {}}


def observation_message(result: StepResult, opts: OpenEnvOptions) -> dict[str, Any]:
    """The user message of an observation: its text (`observation_text`), with the images of
    `openenv_image_field` after it as image parts when the run names one."""
    text = observation_text(result, opts.openenv_prompt_field)
    if opts.openenv_image_field is None:
        return {"role": "user", "content": text}
    found = _observed(result, opts.openenv_image_field, "openenv_image_field")
    images = found if isinstance(found, list) else [found]
    if not all(isinstance(i, str) for i in images):
        raise EnvError("openenv_image_field", f"{opts.openenv_image_field!r} holds base64 or data URLs, not "
                       f"{type(found).__name__}")
    return {"role": "user", "content": [{"type": "text", "text": text}, *(_image_part(i) for i in images)]}


def _image_part(image: str, media_type: str = "image/png") -> dict[str, Any]:
    """An image part of the chat API (a data URL; the buffer reads the kind from the bytes)."""
    url = image if image.startswith("data:") else f"data:{media_type};base64,{image}"
    return {"type": "image_url", "image_url": {"url": url}}


def _observed(result: StepResult, field: str, option: str) -> Any:
    """The observation's `field` (dotted, looked up in the observation then its metadata); EnvError naming
    `option` when it has none."""
    obs = result.observation
    for source in (obs, obs.get("metadata") or result.metadata):
        value: Any = source
        for part in field.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            return value
    raise EnvError(option, f"the observation has no {field!r} (fields: {sorted(obs)})")


def observation_text(result: StepResult, field: str | None) -> str:
    """What the policy is shown of an observation: `field` (dotted, looked up in the observation then its
    metadata), else its first text field, else a `prompt` in its metadata, else the observation as JSON."""
    obs = result.observation
    meta = obs.get("metadata") or result.metadata
    if field is not None:
        value = _observed(result, field, "openenv_prompt_field")
        return value if isinstance(value, str) else json.dumps(value)
    for key in _TEXT_FIELDS:
        if isinstance(obs.get(key), str) and obs[key]:
            return str(obs[key])
    if isinstance(meta, dict) and isinstance(meta.get("prompt"), str):
        return str(meta["prompt"])
    return json.dumps({k: v for k, v in obs.items() if k != "metadata"})


def tool_content(result: StepResult) -> str | list[dict[str, Any]]:
    """An MCP tool's answer as the tool message: its text content (with its image content as image parts: a
    screenshot tool), or its error."""
    obs = result.observation
    error = obs.get("error")
    if error:
        return f"Error: {error.get('message') if isinstance(error, dict) else error}"
    content = (obs.get("result") or {}).get("content") if isinstance(obs.get("result"), dict) else None
    if not isinstance(content, list):
        return json.dumps(obs.get("result"))
    items = [c for c in content if isinstance(c, dict)]
    if not any(c.get("type") == "image" and isinstance(c.get("data"), str) for c in items):
        return "\n".join(str(c.get("text", "")) for c in items)
    return [_image_part(c["data"], str(c.get("mimeType") or "image/png"))
            if c.get("type") == "image" and isinstance(c.get("data"), str)
            else {"type": "text", "text": str(c.get("text", ""))} for c in items]


def action_from(reply: str, action_schema: dict[str, Any], field: str | None) -> dict[str, Any]:
    """The policy's reply as an action: into `field`; else a JSON object reply as it is; else into the action's
    one required field."""
    if field is not None:
        return {field: reply}
    text = reply.strip()
    if text.startswith("```") and text.endswith("```"):
        text = "\n".join(text.splitlines()[1:-1]).strip()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        return parsed
    required = [r for r in action_schema.get("required") or [] if r != "metadata"]
    if len(required) != 1:
        raise EnvError("openenv_action_field", f"the action has required fields {required}: name the one the "
                       "reply fills with openenv_action_field")
    return {required[0]: reply}
