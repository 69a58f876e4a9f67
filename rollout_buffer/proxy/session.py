"""One agent session: its message tree, the one-turn pipeline, and the records it closes into.

A turn: route the request in the tree (continue / fork / new), append the messages the branch does not hold
(loss 0), generate one assistant turn through the run's engine client (exact output ids, retries, abort
resume, affinity by the session's uid), parse the output into text, reasoning and tool calls, commit. Each
turn runs as its own task: a client that hangs up cancels it, and a cancelled or failed turn leaves its
branch exactly as it was before the request (nothing half-appended). A committed turn the client then did not
receive (a stream cut before its end) is undone the same way, unless something was built on it since.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Literal, Protocol

from jinja2 import TemplateError
from pydantic import Field

from rollout_buffer.clock import SYSTEM, Clock
from rollout_buffer.delivery.store import StoreError
from rollout_buffer.engine.results import EngineError
from rollout_buffer.engine.sglang_wire import GenerateDelta
from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.options import RunOptions
from rollout_buffer.observability import metrics
from rollout_buffer.proxy.history import HistoryCache
from rollout_buffer.proxy.journal import Journal
from rollout_buffer.proxy.messages import MessageKey, WireError, message_key, tools_key
from rollout_buffer.proxy.replies import Reply, ReplyParser, ReplyPart
from rollout_buffer.proxy.request_bodies import BodyCache
from rollout_buffer.proxy.session_images import take_images
from rollout_buffer.proxy.session_records import branch_records
from rollout_buffer.proxy.tree import Branch, ResponseRef, Route, SessionTree
from rollout_buffer.schemas import Trajectory, TrajectoryRecord
from rollout_buffer.tokens.conversation import Conversation
from rollout_buffer.tokens.marks import TurnMark

log = logging.getLogger(__name__)

# How long closing a session waits for turns still being generated before it cancels them.
FINISH_WAIT_S = 30.0
# Gets the parts of a streamed reply as they are parsed.
PartSink = Callable[[list[ReplyPart]], None]
# Output tokens decoded to tell which stop sequence ended a turn.
_STOP_TAIL_TOKENS = 16


class HarnessRun(Protocol):
    """The run a harness session writes to: the generation `Run` in the buffer, or in a session worker the
    `WorkerRun` that hands its records to the buffer."""

    run_id: str

    async def wait_loaded(self, timeout_s: float) -> RunResources:
        """The run's resources once loaded; RuntimeError naming `run_id` when it is not running or not ready."""
        ...

    def session_opened(self, session_id: str) -> None:
        """A session of the run opened or was restored."""

    def session_closed(self, session_id: str) -> None:
        """A session of the run closed, whatever its outcome."""

    def session_failed(self, kind: str) -> None:
        """A session of the run was closed as failed (`kind`: why) with its records."""

    def failed(self, item: dict[str, Any], ctx: RolloutContext, kind: str, text: str) -> TrajectoryRecord:
        """The record of a failed trajectory, counted."""
        ...

    async def accept(self, records: list[TrajectoryRecord]) -> None:
        """Store the session's records in the run (raises StoreError when they are not)."""


class ProxyOptions(RunOptions):
    """The run options of agent sessions (extra keys of `/start_rollout`)."""

    error_prefix: ClassVar[str] = "agent session options"

    session_ttl_s: float = Field(default=3600.0, gt=0)
    max_context_tokens: int | None = Field(default=None, ge=1)
    model_name: str = Field(default="policy", min_length=1)
    tool_call_parser: Literal["hermes"] = "hermes"
    # Harness sessions written to their files turn by turn (they survive a restart); off saves the write per turn.
    session_journal: bool = True


@dataclass
class TurnRequest:
    """One request of either protocol, translated: canonical messages and tools, the client's sampling."""

    protocol: str
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sampling: dict[str, Any]  # temperature, top_p, top_k, seed, presence/frequency penalty
    max_tokens: int | None
    stops: list[str]
    stream: bool
    include_usage: bool = False
    parse_tool_calls: bool = True  # False when the client asked for no tool calls (tool_choice none)
    response_id: str = ""  # the id of the answer, in the protocol's style
    created: int = field(default_factory=lambda: int(time.time()))
    # Kept so a later request can continue from this turn by its response id (the Responses API's
    # `previous_response_id`); `instructions` leading messages are this request's own, not carried over.
    remember: bool = False
    instructions: int = 0
    keys: list[MessageKey] | None = None  # the match key of each message, when the adapter has them
    lane: str | None = None  # the client's own conversation id (its X-Session-ID header), when it sends one


@dataclass
class TurnResult:
    """A served turn: the reply, and what undoing it needs."""

    reply: Reply
    route: str
    branch: Branch | None = None
    mark: TurnMark | None = None
    keys_before: int = 0
    new_branch: bool = False
    seq: int | None = None  # the turn's row in the session's journal
    response: ResponseRef | None = None  # where a later request naming this answer continues from


@dataclass
class _Pending:
    branch: Branch
    route: Route
    new: bool
    base: TurnMark | None
    remainder: list[dict[str, Any]]


class SessionKind(StrEnum):
    """Who opened a session and who ends it."""

    HARNESS = "harness"  # opened over HTTP (`POST /sessions`), finished by the harness or its TTL
    GENERATOR = "generator"  # opened by a generator for one trajectory, closed by it


@dataclass
class Session:
    """An open session of one `kind`."""

    session_id: str
    api_key: str
    ctx: RolloutContext
    kind: SessionKind
    options: ProxyOptions
    base_url: str
    anthropic_base_url: str
    agent_socket: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    run: HarnessRun | None = None  # the run a harness session writes to
    # Called once when the session is closed, with the outcome (the manager forgets it).
    on_closed: Callable[[Session, str], None] = lambda _session, _outcome: None
    # Persists committed turns (harness sessions, so they survive a restart); None: memory only.
    journal: Journal | None = None
    tree: SessionTree = field(default_factory=SessionTree)
    responses: dict[str, ResponseRef] = field(default_factory=dict)
    history: HistoryCache = field(default_factory=HistoryCache)
    bodies: BodyCache = field(default_factory=BodyCache)
    state: str = "open"
    images_omitted: int = 0  # images the run's checkpoint cannot read, sent as a placeholder
    created_at: float = field(default_factory=time.time)
    clock: Clock = SYSTEM  # what its idle time is read on (`proxy.expiry`)
    last_active: float = field(default_factory=time.monotonic)
    _tasks: set[asyncio.Task[TurnResult]] = field(default_factory=set)

    # ---- turns ---------------------------------------------------------------------------------------
    def start_turn(self, req: TurnRequest, sink: PartSink | None = None) -> asyncio.Task[TurnResult]:
        """Start generating one turn; await it with `outcome`. With a `sink`, the engine streams and the sink
        gets the reply's parts as they are parsed (the last ones just before the turn commits)."""
        self.require_open()
        self.last_active = self.clock.monotonic()
        task = asyncio.create_task(self._turn(req, sink), name=f"turn-{self.session_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def turn(self, req: TurnRequest) -> TurnResult:
        """One turn, start to end."""
        return await self.outcome(self.start_turn(req))

    async def outcome(self, task: asyncio.Task[TurnResult]) -> TurnResult:
        """The result of a turn task; a turn cancelled by the session's closing is a not-found error."""
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and current is not None and not current.cancelling():
                raise WireError("not_found", f"session {self.session_id} was closed during this turn") from None
            raise

    @property
    def generating(self) -> bool:
        """True while a turn is being generated."""
        return any(not t.done() for t in self._tasks)

    def require_open(self) -> None:
        """WireError unless the session takes requests."""
        if self.state != "open":
            raise WireError("not_found", f"session {self.session_id} is {self.state}")

    async def _turn(self, req: TurnRequest, sink: PartSink | None) -> TurnResult:
        self.images_omitted += await take_images(req.messages, self.ctx.run.images)
        keys = req.keys if req.keys is not None else [message_key(m) for m in req.messages]
        tkey = tools_key(req.tools)
        route = self.tree.route(keys, tkey, req.lane)
        pending = await self._prepare(route, req, keys, tkey)
        conv = pending.branch.conv
        parser = ReplyParser(bool(req.tools) and req.parse_tool_calls, conv.prompt_opens_reasoning)

        def on_delta(delta: GenerateDelta) -> None:
            parts = parser.feed(delta.text)
            if parts and sink is not None:
                sink(parts)

        messages_before = len(conv.messages) + len(pending.remainder)
        try:
            if pending.remainder:
                await _rendered(conv.aadd_context(pending.remainder), req)
            prompt_tokens = conv.generation_length()
            overrides = self._sampling(req, prompt_tokens)
            before = len(conv.token_ids)
            finish = await self.ctx.generate(conv, on_delta=on_delta if sink is not None else None, **overrides)
        except BaseException as e:
            self._roll_back(pending)
            if isinstance(e, EngineError):
                if e.kind == "refused" or (e.kind == "http_4xx" and e.status == 400):
                    raise WireError("invalid_request", f"the engine refused the request: {e.reason}") from None
                raise WireError("engine", f"the engine failed: {e.reason}") from None
            raise
        if len(conv.messages) == messages_before:  # no room left in the trajectory's token budget
            self._roll_back(pending)
            return TurnResult(Reply("", "", [], "length", prompt_tokens, 0), route.kind)
        if finish == "abort" or self.state != "open":
            self._roll_back(pending)
            if finish == "abort":
                raise WireError("engine", "the engine aborted the generation; send the request again")
            raise WireError("not_found", f"session {self.session_id} was closed during this turn")
        reply = self._reply(conv, before, prompt_tokens, finish, req, parser, sink)
        result = self._commit(pending, keys, reply, req)
        if self.journal is not None:
            self._persist(result, pending, req)
        return result

    def _persist(self, result: TurnResult, pending: _Pending, req: TurnRequest) -> None:
        """Write the committed turn to the session's file; a turn that cannot be written is taken back, so what
        the session holds is what the file holds."""
        assert self.journal is not None and result.branch is not None
        try:
            response = (req.response_id, result.response) if result.response is not None else None
            result.seq = self.journal.turn(result.branch, pending.route, pending.base, result.reply, req.protocol,
                                           response)
        except StoreError as e:
            self.undo(result)
            raise WireError("server", f"the turn could not be stored: {e}") from None

    async def _prepare(self, route: Route, req: TurnRequest, keys: list[MessageKey], tkey: bytes) -> _Pending:
        if route.kind == "continue":
            assert route.branch is not None
            route.branch.busy = True
            return _Pending(route.branch, route, False, route.branch.marks[-1], req.messages[route.start:])
        if route.kind == "fork":
            parent = route.branch
            assert parent is not None
            conv = parent.conv.fork(parent.marks[route.turns - 1])
            branch = Branch(conv, keys[:route.start], tkey, list(parent.marks[:route.turns]), route.turns,
                            parent.id, route.shared, busy=True, messages=req.messages[:route.start])
            return _Pending(branch, route, True, None, req.messages[route.start:])
        conv = await _rendered(self.ctx.conversation(req.messages, tools=req.tools), req)
        parent_id = route.branch.id if route.branch is not None else None
        return _Pending(Branch(conv, [], tkey, parent=parent_id, shared_messages=route.shared, busy=True), route,
                        True, None, [])

    def _sampling(self, req: TurnRequest, prompt_tokens: int) -> dict[str, Any]:
        """The client's sampling where the run sets none (the run's settings win), and its token cap."""
        run_params = self.ctx.run.sampling_params
        overrides = {k: v for k, v in req.sampling.items() if k not in run_params}
        if req.stops and "stop" not in run_params:
            overrides["stop"] = req.stops
        caps = [req.max_tokens, run_params.get("max_tokens"), run_params.get("max_new_tokens")]
        limit = self.options.max_context_tokens
        if limit is not None:
            if prompt_tokens >= limit:
                raise WireError("context_length", f"the prompt has {prompt_tokens} tokens; this run allows "
                                f"{limit} (max_context_tokens)", "messages")
            caps.append(limit - prompt_tokens)
        given = [int(c) for c in caps if c is not None]
        if given:
            overrides["max_tokens"] = min(given)
        return overrides

    def _reply(self, conv: Conversation, before: int, prompt_tokens: int, finish: str, req: TurnRequest,
               parser: ReplyParser, sink: PartSink | None) -> Reply:
        output = [t for t, m in zip(conv.token_ids[before:], conv.loss_mask[before:], strict=True) if m]
        content = conv.messages[-1]["content"]
        if content.startswith(parser.fed):
            rest = parser.feed(content[len(parser.fed):]) + parser.close()
            if rest and sink is not None:
                sink(rest)
        else:  # the streamed text is not the turn's (not seen from SGLang): the reply follows the turn
            log.warning("session %s: the streamed text differs from the turn's; the reply follows the turn",
                        self.session_id)
            parser = ReplyParser(parser.tools_offered, parser.reasoning_open)
            parser.feed(content)
            parser.close()
        text, reasoning, calls, errors = parser.text, parser.reasoning, parser.calls, parser.errors
        stop_sequence = None
        if finish == "stop" and req.stops and output:
            assert self.ctx.tokenizer is not None  # sessions open in token mode only (LocalBackend._register)
            tail = self.ctx.tokenizer.decode(output[-_STOP_TAIL_TOKENS:], skip_special_tokens=True)
            stop_sequence = next((s for s in req.stops if s in tail), None)
        wire_finish = ("tool_calls" if calls else "length" if finish == "length"
                       else "stop_sequence" if stop_sequence is not None else "stop")
        return Reply(text, reasoning, calls, wire_finish, prompt_tokens, len(output), stop_sequence,
                     bool(errors), errors)

    def _commit(self, pending: _Pending, keys: list[MessageKey], reply: Reply, req: TurnRequest) -> TurnResult:
        branch = pending.branch
        keys_before = len(branch.keys)
        branch.keys.extend(keys[pending.route.start:])
        branch.messages.extend(req.messages[pending.route.start:])
        reply_message = reply.message()
        branch.keys.append(message_key(reply_message))
        branch.messages.append(reply_message)
        mark = branch.conv.mark()
        branch.marks.append(mark)
        branch.tool_calls += len(reply.calls)
        branch.ill_formed += reply.ill_formed
        branch.protocols.add(req.protocol)
        branch.busy = False
        if pending.new:
            branch.lane = req.lane
            self.tree.add(branch)
            if pending.route.kind == "fork" and pending.route.branch is not None:
                pending.route.branch.forked_at.add(pending.route.turns)
        self.tree.touch(branch)
        response = None
        if req.remember:
            response = ResponseRef(branch, mark, req.instructions, frozenset(c.id for c in reply.calls))
            self.responses[req.response_id] = response
        self.last_active = self.clock.monotonic()
        metrics.PROXY_TURNS.labels(req.protocol, pending.route.kind).inc()
        return TurnResult(reply, pending.route.kind, branch, mark, keys_before, pending.new, response=response)

    def _roll_back(self, pending: _Pending) -> None:
        pending.branch.busy = False
        if pending.base is not None:
            pending.branch.conv.restore(pending.base)

    def undo(self, result: TurnResult) -> bool:
        """Take back a committed turn the client never received; False when something was built on it."""
        branch = result.branch
        if branch is None or result.mark is None or self.state != "open":
            return False
        if branch.busy or branch.marks[-1] is not result.mark or len(branch.marks) in branch.forked_at:
            return False
        if result.new_branch:
            self.tree.remove(branch)  # its parent's turn stays marked as forked from: harmless, and safe
        else:
            branch.marks.pop()
            branch.conv.restore(branch.marks[-1])
            del branch.keys[result.keys_before:]
            del branch.messages[result.keys_before:]
            branch.tool_calls -= len(result.reply.calls)
            branch.ill_formed -= result.reply.ill_formed
        if self.journal is not None and result.seq is not None:
            try:
                self.journal.undo(result.seq)
            except StoreError as e:  # the file keeps the turn: a restart would bring it back
                log.error("session %s: a turn taken back could not be written as such: %s", self.session_id, e)
        log.info("session %s: a turn the client did not receive was taken back", self.session_id)
        return True

    def continued(self, response_id: str) -> tuple[list[dict[str, Any]], list[MessageKey], frozenset[str]]:
        """The canonical messages a request naming `response_id` continues from (that turn's history and answer,
        its request's instructions left out), their match keys, and the ids of the tool calls that answer made.
        WireError naming `previous_response_id` for a response this session did not give or took back."""
        where = "previous_response_id"
        ref = self.responses.get(response_id)
        if ref is None:
            raise WireError("invalid_request", f"{where}: no response {response_id!r} in this session", where)
        branch = ref.branch
        if (branch.id is None or self.tree.branches.get(branch.id) is not branch
                or not any(m is ref.mark for m in reversed(branch.marks))):
            raise WireError("invalid_request", f"{where}: response {response_id!r} was taken back (its client did "
                            "not receive it whole)", where)
        at = slice(ref.instructions, ref.mark.messages)
        return branch.messages[at], branch.keys[at], ref.call_ids

    async def count_tokens(self, req: TurnRequest) -> int:
        """Tokens of the request's prompt as the chat template renders it (nothing is generated or kept)."""
        await take_images(req.messages, self.ctx.run.images)
        conv = await _rendered(self.ctx.conversation(req.messages, tools=req.tools), req)
        return len(conv.token_ids)

    # ---- closing -------------------------------------------------------------------------------------
    async def close(self, reward: float, **extra_info: Any) -> list[Trajectory]:
        """Close the session and return its records (`AgentSession.close`)."""
        await self.stop("finished")
        try:
            return await branch_records(self, reward, **extra_info)
        finally:
            self.on_closed(self, "finished" if self.tree.branches else "empty")

    async def discard(self, reason: str) -> None:
        """Close the session without records (`AgentSession.discard`)."""
        await self.stop("failed")
        log.info("session %s discarded: %s", self.session_id, reason)
        self.on_closed(self, "discarded")

    async def stop(self, state: str, wait_s: float = FINISH_WAIT_S) -> None:
        """Take no more requests; wait for turns in flight up to `wait_s`, then cancel them."""
        if self.state == "open":
            self.state = state
        tasks = [t for t in self._tasks if not t.done()]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=wait_s) if wait_s > 0 else (set(), set(tasks))
            for t in late:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def transcript(self) -> list[dict[str, Any]]:
        """The messages of the branch that committed last (`AgentSession.transcript`)."""
        latest = self.tree.latest
        return list(latest.conv.messages[:latest.marks[-1].messages]) if latest is not None else []

    def harness_run(self) -> HarnessRun:
        """The run a harness session writes its records to; RuntimeError for a generator's session."""
        if self.run is None:
            raise RuntimeError(f"session {self.session_id} belongs to a generator, not to a run's harness")
        return self.run

    def view(self) -> dict[str, Any]:
        """JSON-ready state of the session and its tree."""
        return {
            "session_id": self.session_id,
            "kind": self.kind,
            "state": self.state,
            "run_id": self.ctx.run.run_id,
            "instance_id": self.ctx.instance_id,
            "uid": self.ctx.uid,
            "created_at": self.created_at,
            "idle_s": self.clock.monotonic() - self.last_active,
            "metadata": self.metadata,
            "base_url": self.base_url,
            "latest_branch": self.tree.latest.id if self.tree.latest is not None else None,
            "branches": self.tree.view(),
        }


async def _rendered(render: Any, req: TurnRequest) -> Any:
    """Await a chat-template render; a template that cannot render the request is the client's error."""
    try:
        return await render
    except (TemplateError, TypeError, ValueError) as e:
        where = "tools" if req.tools else "messages"
        raise WireError("invalid_request", f"the chat template cannot render this request: {e}", where) from None

