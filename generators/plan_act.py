"""Plan/Act: a planner splits the task into sub-tasks, an actor works each with tools, one shared reward.

One episode per trajectory. The planner gets the task and writes a plan (`generators.plan_act_format`
documents the format); each step goes, in order, to the actor in a conversation of its own (system prompt,
then the task, the results of the episode's earlier sub-tasks and the sub-task, with the run's tools in the
chat template), which calls tools (hermes `<tool_call>`s or OpenAI `tool_calls`, as in the tool-calling
generator) until it replies without a call, for at most `max_actor_turns` turns. The planner then reads one
`<report>` per step and revises the plan or answers, for at most `max_turns` planner turns. A sub-task that
fails (engine error after its retries, a cut reply, no answer in time) is reported to the planner as `failed`:
the episode goes on. A role's engine that is down (unreachable after the retries) fails the episode instead,
with the role in the reason (`error_kind` `actor_engine_connection`, `planner_engine_<kind>`): every further
turn of that role would fail the same way.

Both roles share the run's engine unless `planner_engine_url` / `actor_engine_url` name others. Every call of
an episode uses the episode's uid as session id, so each engine client keeps the episode on one engine (both
roles on the same one when they share the client) and each role's stable prompt prefix stays in its cache.

The episode is a list of records, planner first, then one per sub-task the actor answered or was cut on (a
sub-task whose conversation has no final assistant turn, e.g. its first call failed, has no sample). Each
keeps its role's exact tokens and loss mask. Reward: one scalar per episode, the planner's final answer
scored by math-verify against `label` or by exact match against `golden_answers` / `answer` (`scorer`;
`auto` picks math-verify when the row has a `label`), 0 without an answer. Every record carries it times its
role weight, and `extra_info` has `agent_id` (`planner` / `actor`), `episode_id`, `turn` (the planning
round), `subtask_index` (None for the planner), `reward_weight` and `episode_reward`, from which the buffer
normalizes over episodes.

Input rows: `prompt` (a string or OpenAI messages) or `question`; `label`, or `golden_answers` / `answer`;
`tools_kwargs` (optional, per tool, as in the tool-calling generator). Run options: `PlanActOptions`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from generators.math import prompt_messages
from generators.plan_act_format import (
    INVALID_PLAN_HINT,
    Report,
    actor_prompt,
    parse_planner_turn,
    render_reports,
    split_reasoning,
    tool_list,
)
from generators.plan_act_run import PlanActRun, plan_act_run
from generators.scoring import answer_reward
from generators.tools import ToolRegistry, ToolSession, message_tool_calls, truncate_response
from rollout_buffer.generator_api import INLINE_CHARS, Conversation, EngineError, RolloutContext, Trajectory

TASK_TYPE = "plan_act"
REQUIRED_FIELDS = (("prompt", "question"), ("label", "golden_answers", "answer"))

# Tokens the planner needs past a report: the template's framing of the user turn and a reply worth having.
_MIN_REPLY_TOKENS = 32


class RoleEngineError(Exception):
    """A role's engine failed the episode; `error_kind` (the runner's failure reason) names the role."""

    def __init__(self, role: str, error: EngineError):
        super().__init__(f"the {role} engine is {'down' if error.kind == 'connection' else 'failing'}: {error}")
        self.error_kind = f"{role}_engine_{error.kind}"


@dataclass
class Subtask:
    """One step of a plan: what the actor did with it and what the planner is told."""

    turn: int
    index: int  # over the episode's steps, in plan order
    position: int  # 1-based, in its plan
    step: str
    status: str = "skipped"  # done | failed | skipped
    result: str = ""
    stop_reason: str | None = None
    actor_turns: int = 0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    ctx: RolloutContext | None = None
    conv: Conversation | None = None
    finish: str = "stop"

    def report(self) -> Report:
        """What the planner reads about this step."""
        return Report(self.position, self.step, self.status, self.result)

    def summary(self) -> dict[str, Any]:
        """The planner record's view of this step."""
        return {"turn": self.turn, "subtask_index": self.index, "step": self.step, "status": self.status,
                "stop_reason": self.stop_reason, "has_sample": self.has_sample()}

    def has_sample(self) -> bool:
        """True when the actor's conversation ends with a reply, as a trainable sample must."""
        if self.conv is None or not self.conv.messages:
            return False
        last = self.conv.messages[-1]
        return last.get("role") == "assistant" and bool(str(last.get("content") or "").strip())


def _role_context(ctx: RolloutContext) -> RolloutContext:
    """The episode's context with engine counters of its own, so each record reports its own calls."""
    return dataclasses.replace(ctx, engine_stats={"turns": 0, "abort_resumes": 0, "engines": []})


def _tools_kwargs(item: dict[str, Any]) -> dict[str, Any]:
    found = item.get("tools_kwargs") or (item.get("extra_info") or {}).get("tools_kwargs") or {}
    return found if isinstance(found, dict) else {}


def task_messages(item: dict[str, Any], system_prompt: str) -> list[dict[str, Any]]:
    """The planner's opening messages: its system prompt, then the task (`prompt`, else `question`)."""
    if item.get("prompt") is not None:
        return prompt_messages(item, system_prompt)
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": str(item["question"]).strip()}]


def task_text(messages: list[dict[str, Any]]) -> str:
    """The task as the actor sees it: the last user message."""
    content = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    return content if isinstance(content, str) else str(content)


@dataclass
class Episode:
    """One episode's shared state: the run, the actor's tools and tool session, the sub-tasks so far."""

    ctx: RolloutContext
    run: PlanActRun
    tools: ToolRegistry
    session: ToolSession
    task: str
    subtasks: list[Subtask] = field(default_factory=list)
    # (step, result) of the sub-tasks done so far, shown to the actor in later ones.
    results: list[tuple[str, str]] = field(default_factory=list)

    async def run_plan(self, steps: tuple[str, ...], turn: int) -> list[Subtask]:
        """Give the plan's steps to the actor in order; each sees the results of the sub-tasks done before it."""
        limit = self.run.options.max_subtasks_per_turn
        planned = []
        for position, step in enumerate(steps, start=1):
            sub = Subtask(turn, len(self.subtasks), position, step)
            if position > limit:
                sub.result = f"not run: at most {limit} sub-tasks per plan"
            else:
                await self.act(sub)
                if sub.status == "done":
                    self.results.append((step, sub.result))
            self.subtasks.append(sub)
            planned.append(sub)
        return planned

    async def act(self, sub: Subtask) -> None:
        """Work one sub-task; failures end up in `sub.status` / `sub.result`, never raised."""
        opts = self.run.options
        sub.ctx = actx = _role_context(self.ctx)
        messages = [{"role": "system", "content": opts.actor_system_prompt},
                    {"role": "user", "content": actor_prompt(self.task, sub.step, self.results)}]
        sub.conv = conv = await actx.conversation(messages, tools=self.tools.schemas or None)
        failure: str | None = None
        try:
            while True:
                before = len(conv.messages)
                sub.finish = await actx.generate(conv, engine=self.run.actor_engine, session=self.ctx.uid,
                                                 **opts.actor_sampling_params)
                if len(conv.messages) == before:
                    sub.stop_reason, failure = "max_tokens", "no tokens left for another turn"
                    break
                sub.actor_turns += 1
                if sub.finish != "stop":
                    sub.stop_reason, failure = sub.finish, f"its reply was cut ({sub.finish})"
                    break
                calls = message_tool_calls(conv.messages[-1])
                if not calls:
                    sub.stop_reason = "answer"
                    break
                if sub.actor_turns >= opts.max_actor_turns:
                    sub.stop_reason, failure = "max_actor_turns", f"no answer within {opts.max_actor_turns} turns"
                    break
                outcomes = await self.session.run(calls)
                sub.tool_calls += [{"turn": sub.actor_turns, "name": o.name, "arguments": o.arguments,
                                    **({"error": o.error} if o.error else {})} for o in outcomes]
                await conv.aadd_messages([o.message() for o in outcomes])
        except EngineError as e:
            if e.kind == "connection":  # the actor's engine is down: no sub-task of the episode can run
                raise RoleEngineError("actor", e) from None
            sub.stop_reason, failure = "engine_error", f"engine error: {e}"
        if failure is None:
            sub.status = "done"
            reply = split_reasoning(conv.messages[-1]["content"])[1].strip() or "(an empty reply)"
            sub.result = truncate_response(reply, opts.max_report_length)
        else:
            sub.status, sub.result = "failed", f"the actor failed: {failure}"


async def _room_for_reply(ctx: RolloutContext, conv: Conversation, text: str) -> bool:
    """Whether the planner can still reply after `text` within the run's `max_tokens`.

    Checked before the text is added: a planner sample ending with a user turn would drop its whole group.
    """
    budget = ctx.run.max_tokens
    if not conv.token_mode or budget is None or ctx.tokenizer is None:
        return True
    encode = ctx.tokenizer.encode
    n = len(encode(text, add_special_tokens=False) if len(text) <= INLINE_CHARS
            else await asyncio.to_thread(encode, text, add_special_tokens=False))
    return conv.response_tokens_used() + n + _MIN_REPLY_TOKENS <= budget


async def run_rollout(item: dict[str, Any], ctx: RolloutContext) -> list[Trajectory]:
    """Run one plan/act episode; returns the planner's record, then the actor's, sharing one reward."""
    run = plan_act_run(ctx)
    opts = run.options
    tools = await run.tools()
    messages = task_messages(item, opts.planner_system_prompt.replace("{tools}", tool_list(tools.schemas)))
    pctx = _role_context(ctx)
    planner = await pctx.conversation(messages)
    session = ToolSession(tools, f"{ctx.uid}:actor", opts.limits(), _tools_kwargs(item))
    episode = Episode(ctx, run, tools, session, task_text(messages))
    answer: str | None = None
    stop_reason, finish, turn, planner_turns = "max_turns", "stop", 0, 0
    try:
        for turn in range(opts.max_turns):
            before = len(planner.messages)
            try:
                finish = await pctx.generate(planner, engine=run.planner_engine, session=ctx.uid,
                                             **opts.planner_sampling_params)
            except EngineError as e:
                raise RoleEngineError("planner", e) from None
            if len(planner.messages) == before:
                stop_reason = "max_tokens"
                break
            planner_turns += 1
            if finish != "stop":
                stop_reason = finish
                break
            parsed = parse_planner_turn(planner.messages[-1]["content"])
            if parsed.answer is not None:
                answer, stop_reason = parsed.answer, "answer"
                break
            if turn + 1 == opts.max_turns:
                break
            if parsed.steps:
                done = await episode.run_plan(parsed.steps, turn)
                observation = render_reports([s.report() for s in done], turn + 2 == opts.max_turns)
            else:
                observation = INVALID_PLAN_HINT
            if not await _room_for_reply(ctx, planner, observation):
                stop_reason = "max_tokens"
                break
            await planner.aadd_messages([{"role": "user", "content": observation}])
    finally:
        await session.close()
        run.release(ctx.uid)

    reward, scorer, reference = await answer_reward(answer, item, opts.scorer, opts.reward_timeout_s)
    shared = {"episode_id": ctx.uid, "episode_reward": reward, "scorer": scorer}
    w_planner, w_actor = opts.planner_reward_weight, opts.actor_reward_weight
    records = [await pctx.trajectory(
        planner, reward * w_planner, finish, agent_id="planner", turn=turn, subtask_index=None,
        reward_weight=w_planner, **shared, **reference, answer=answer, stop_reason=stop_reason,
        planner_turns=planner_turns, subtasks=[s.summary() for s in episode.subtasks],
    )]
    for sub in episode.subtasks:
        if sub.has_sample() and sub.ctx is not None and sub.conv is not None:
            records.append(await sub.ctx.trajectory(
                sub.conv, reward * w_actor, sub.finish, agent_id="actor", turn=sub.turn, subtask_index=sub.index,
                reward_weight=w_actor, **shared, step=sub.step, step_position=sub.position,
                subtask_status=sub.status, stop_reason=sub.stop_reason, actor_turns=sub.actor_turns,
                tool_calls=sub.tool_calls,
            ))
    return records
