"""What every episode of a plan/act run shares: its options, an engine client per role, the actor's tools.

Made once per run by the first episode (`plan_act_run`) and kept in `ctx.run.shared`; the runner calls
`aclose()` when the run ends, which closes the engine clients and the search client made here.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from generators.plan_act_format import ACTOR_SYSTEM_PROMPT, PLANNER_SYSTEM_PROMPT
from generators.scoring import Scorer
from generators.search import SearchConfig, format_documents
from generators.search_client import SearchClient
from generators.tool_call import default_tool_config
from generators.tools import BaseTool, CallLimits, ToolRegistry, TruncateSide, load_tool_config
from rollout_buffer.generator_api import EngineClient, Governed, RolloutContext, RunOptions, check_http_urls

_SHARED_KEY = "plan_act"

ActorTools = Literal["function", "search"]


class PlanActOptions(RunOptions):
    """Run options of the plan/act generator (extra keys of `/start_rollout`)."""

    error_prefix: ClassVar[str] = "plan_act run options"

    max_turns: int = Field(default=4, ge=1, le=64, description="planner turns (planning rounds) at most")
    max_subtasks_per_turn: int = Field(default=4, ge=1, le=64, description="steps of one plan given to the actor")
    max_actor_turns: int = Field(default=4, ge=1, le=64, description="actor turns per sub-task")
    actor_tools: list[ActorTools] = Field(default_factory=lambda: list[ActorTools](["function"]))
    tool_config_path: Annotated[str | None, Governed("code_paths")] = Field(
        default=None, description="function tools (default: the calculator)")
    max_parallel_calls: int = Field(default=1, ge=1)
    max_tool_response_length: int = Field(default=1024, ge=1)
    tool_response_truncate_side: TruncateSide = "middle"
    tool_timeout_s: float = Field(default=30.0, gt=0)
    max_report_length: int = Field(default=1024, ge=1, description="characters of an actor report")
    planner_system_prompt: str = PLANNER_SYSTEM_PROMPT
    actor_system_prompt: str = ACTOR_SYSTEM_PROMPT
    planner_reward_weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    actor_reward_weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    scorer: Scorer = "auto"
    reward_timeout_s: float = Field(default=10.0, gt=0)
    planner_engine_url: Annotated[str | list[str] | None, Governed("urls")] = None
    actor_engine_url: Annotated[str | list[str] | None, Governed("urls")] = None
    planner_sampling_params: dict[str, Any] = Field(default_factory=dict)
    actor_sampling_params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("planner_engine_url", "actor_engine_url")
    @classmethod
    def _urls(cls, v: str | list[str] | None) -> str | list[str] | None:
        check_http_urls(v)
        return v

    def limits(self) -> CallLimits:
        """How the actor's tool calls run."""
        return CallLimits(self.max_parallel_calls, self.max_tool_response_length,
                          self.tool_response_truncate_side, self.tool_timeout_s)


class SearchTool(BaseTool):
    """The retrieval server as a function tool: `search(query)` returns Search-R1's rendering of the hits."""

    default_schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the knowledge base and return the best matching documents.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look for"}},
                "required": ["query"],
            },
        },
    }

    def __init__(self, client: SearchClient) -> None:
        super().__init__()
        self.client = client

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> str:
        """One search; a SearchError becomes the tool's error message (see ToolSession)."""
        query = parameters.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ValueError('search needs a non-empty "query" string')
        docs, _cached = await self.client.search(query)
        return format_documents(docs)


def _function_tools(options: PlanActOptions) -> ToolRegistry:
    """The function tools of the tool config (blocking: file reads and imports)."""
    return load_tool_config(options.tool_config_path or default_tool_config())


async def _load_tools(options: PlanActOptions, search: SearchClient | None) -> ToolRegistry:
    registry = ToolRegistry()
    if "function" in options.actor_tools:
        for tool in await asyncio.to_thread(_function_tools, options):
            registry.add(tool)
    if search is not None:
        registry.add(SearchTool(search))
    return registry


def _urls(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


@dataclass
class PlanActRun:
    """Options, engine clients and tools of one run."""

    options: PlanActOptions
    planner_engine: EngineClient
    actor_engine: EngineClient
    search: SearchClient | None
    _tools: asyncio.Task[ToolRegistry]
    _own_engines: list[EngineClient] = field(default_factory=list)

    @classmethod
    def create(cls, config: dict[str, Any], run_engine: EngineClient) -> PlanActRun:
        """Validate the options and make the clients; the tools load in a background thread."""
        options = PlanActOptions.from_run(config)
        own: list[EngineClient] = []

        def role_engine(urls: str | list[str] | None) -> EngineClient:
            if urls is None:
                return run_engine
            client = run_engine.sibling(_urls(urls))  # the run's engine options, as the run's own engines
            own.append(client)
            return client

        search = None
        if "search" in options.actor_tools:
            sc = SearchConfig.from_run(config)
            search = SearchClient(
                sc.search_url, topk=sc.topk, concurrency=sc.search_concurrency, timeout_s=sc.search_timeout_s,
                retries=sc.search_retries, cache_size=sc.search_cache_size, cache_ttl_s=sc.search_cache_ttl_s,
            )
        tools = asyncio.ensure_future(_load_tools(options, search))
        return cls(options, role_engine(options.planner_engine_url), role_engine(options.actor_engine_url),
                   search, tools, own)

    async def tools(self) -> ToolRegistry:
        """The actor's tools, once loaded (shielded: one cancelled episode must not cancel the load)."""
        return await asyncio.shield(self._tools)

    def release(self, session_id: str) -> None:
        """Forget an episode's engine affinity in the clients made here (the runner releases its own)."""
        for engine in self._own_engines:
            engine.release(session_id)

    async def aclose(self) -> None:
        """Close the clients made for this run."""
        if not self._tools.done():
            self._tools.cancel()
        for engine in self._own_engines:
            await engine.aclose()
        if self.search is not None:
            await self.search.aclose()


def plan_act_run(ctx: RolloutContext) -> PlanActRun:
    """The run's shared plan/act state, made by the first episode that asks."""
    run = ctx.run.shared.get(_SHARED_KEY)
    if run is None:
        run = ctx.run.shared[_SHARED_KEY] = PlanActRun.create(ctx.config, ctx.run.engine)
    return run
