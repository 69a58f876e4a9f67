"""Search-R1: answer a question by searching a retrieval server, rewarded by exact match with the answers.

Each assistant turn is one action, as in Search-R1: `<search> query </search>` or `<answer> ... </answer>`
(generation stops at either closing tag). A search's results come back as Search-R1's observation,
`<information>Doc 1(Title: ...) ...</information>`; a failed search as `<error>...</error>`; a turn with neither
action gets a hint. Observations are user turns, so their tokens are the chat template's (loss 0) and the
model's turns keep the engine's own tokens and log-probs (loss 1). The loop ends on an answer, a cut turn or
after `max_turns` assistant turns; no observation follows the last turn.

Reward (Search-R1's exact match): 1.0 when the answer equals a golden answer after normalisation (lower case,
no punctuation, no articles, single spaces); `format_score` when it does not but the trajectory is well
formed (think, then search → information → think repeated, then answer, nothing between the tags); else 0.

Input rows (Search-R1 / NQ): `question`, `golden_answers` (or `answer`): a string or a list, optional
`metadata` (copied into `extra_info`). Run options in the `/start_rollout` payload: see `SearchConfig`.
"""

from __future__ import annotations

import logging
import os
import re
import string
from collections import Counter
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator

from generators.search_client import Document, SearchClient, SearchError
from rollout_buffer.generator_api import Governed, RolloutContext, RunOptions, Trajectory, check_http_urls

TASK_TYPE = "search"
REQUIRED_FIELDS = ("question", ("golden_answers", "answer"))

log = logging.getLogger(__name__)

SEARCH_URL_ENV = "ROLLOUT_BUFFER_SEARCH_URL"
DEFAULT_SEARCH_URL = "http://127.0.0.1:8000/retrieve"  # Search-R1's retrieval server
_SHARED_KEY = "search"

# Search-R1's instruction, word for word: checkpoints trained with it expect exactly this text.
SEARCH_R1_PROMPT = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> "
    "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)
INVALID_ACTION_HINT = (
    "Your previous action is invalid. To search, put the query between <search> and </search>. "
    "To give the final answer, put it between <answer> and </answer>. Try again."
)
ACTION_STOPS = ("</search>", "</answer>")

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_TAG = re.compile(r"(</?(?:think|search|information|answer)>)")
# Search-R1's format: (state, tag) → next state; text between tags is allowed only inside a tag.
_TRANSITIONS = {
    ("start", "<think>"): "in_think",
    ("information", "<think>"): "in_think",
    ("in_think", "</think>"): "after_think",
    ("after_think", "<search>"): "in_search",
    ("in_search", "</search>"): "after_search",
    ("after_search", "<information>"): "in_information",
    ("in_information", "</information>"): "information",
    ("after_think", "<answer>"): "in_answer",
    ("in_answer", "</answer>"): "end",
}
_INSIDE_TAG = frozenset({"in_think", "in_search", "in_information", "in_answer"})
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


class SearchConfig(RunOptions):
    """Run options of the search generator (extra keys of `/start_rollout`); defaults are Search-R1's."""

    error_prefix: ClassVar[str] = "bad search run options"

    max_turns: int = Field(default=2, ge=1, le=100, description="assistant turns at most")
    topk: int = Field(default=3, ge=1, le=100, description="documents per search")
    search_url: Annotated[str, Governed("urls")] = Field(
        default_factory=lambda: os.environ.get(SEARCH_URL_ENV, DEFAULT_SEARCH_URL))
    search_concurrency: int = Field(default=256, ge=1, description="searches in flight over the run")
    search_timeout_s: float = Field(default=60.0, gt=0)
    search_retries: int = Field(default=1, ge=0, le=10, description="retries of an unreachable or 5xx search")
    search_cache_size: int = Field(default=10_000, ge=0, description="queries cached; 0 disables the cache")
    search_cache_ttl_s: float = Field(default=3600.0, gt=0)
    format_score: float = Field(default=0.2, ge=0.0, le=1.0, description="reward of a well-formed wrong answer")
    return_logprob: bool = Field(default=True, description="keep rollout_log_probs in the records")
    prompt_template: str = Field(default=SEARCH_R1_PROMPT, description="the user turn; {question} is replaced")

    @field_validator("prompt_template")
    @classmethod
    def _has_question(cls, v: str) -> str:
        if "{question}" not in v:
            raise ValueError("prompt_template must contain {question}")
        return v

    @field_validator("search_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        check_http_urls(v, "search_url")
        return v


# ------------------------------------------------------------------------------------ task text


def question_text(item: dict[str, Any]) -> str:
    """The question as Search-R1 prepares it: stripped, ending with a question mark."""
    question = str(item["question"]).strip()
    return question if question.endswith("?") else f"{question}?"


def golden_answers(item: dict[str, Any]) -> list[str]:
    """The accepted answers of a row: `golden_answers`, else `answer`; a string or a list of them."""
    value = item.get("golden_answers")
    if value is None:
        value = item.get("answer")
    answers = [value] if isinstance(value, str | int | float) else list(value or [])
    if not answers:
        raise ValueError("the row has no golden_answers or answer")
    return [str(a) for a in answers]


def parse_action(text: str) -> tuple[str | None, str]:
    """("search" | "answer", its content) for the first complete action tag in `text`, else (None, "")."""
    match = _ACTION.search(text)
    return (match.group(1), match.group(2).strip()) if match else (None, "")


def format_documents(docs: list[Document]) -> str:
    """Search-R1's rendering of retrieved documents: `Doc i(Title: <first line>) <rest>`, one per line."""
    lines = []
    for i, doc in enumerate(docs, start=1):
        contents = doc.get("contents")
        if not isinstance(contents, str):
            contents = f'"{doc.get("title", "")}"\n{doc.get("text", "")}'
        title, _, text = contents.partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}")
    return "\n".join(lines).strip()


def information(docs: list[Document]) -> str:
    """The observation of a successful search."""
    return f"<information>{format_documents(docs)}</information>"


# ------------------------------------------------------------------------------------ reward


def normalize_answer(text: str) -> str:
    """Search-R1's (SQuAD's) answer normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact_match(prediction: str, golden: list[str]) -> bool:
    """True when the normalised prediction equals one normalised golden answer."""
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in golden)


def is_well_formed(transcript: str) -> bool:
    """Search-R1's format check of a response: `<think>` first, then `<search>` → `<information>` →
    `<think>` any number of times, then `<answer>`; only whitespace between tags, nothing after."""
    state = "start"
    for part in _TAG.split(transcript):
        if _TAG.fullmatch(part):
            following = _TRANSITIONS.get((state, part))
            if following is None:
                return False
            state = following
        elif part.strip() and state not in _INSIDE_TAG:
            return False
    return state == "end"


def search_reward(answer: str | None, golden: list[str], well_formed: bool, format_score: float) -> float:
    """1.0 for an exact match; `format_score` for a wrong answer in a well-formed trajectory; else 0.0."""
    if answer is not None and exact_match(answer, golden):
        return 1.0
    return format_score if answer is not None and well_formed else 0.0


# ------------------------------------------------------------------------------------ rollout


def _run_state(ctx: RolloutContext) -> tuple[SearchConfig, SearchClient]:
    """The run's options and its one search client, made by the first trajectory."""
    shared, config = ctx.run.shared, ctx.options(SearchConfig)
    if _SHARED_KEY not in shared:  # the runner closes it with the run (a shared value with aclose())
        shared[_SHARED_KEY] = SearchClient(
            config.search_url, topk=config.topk, concurrency=config.search_concurrency,
            timeout_s=config.search_timeout_s, retries=config.search_retries,
            cache_size=config.search_cache_size, cache_ttl_s=config.search_cache_ttl_s,
        )
    return config, shared[_SHARED_KEY]


def _stops(run_stop: str | list[str] | None) -> list[str]:
    """The run's own stop strings plus the closing action tags."""
    own = [run_stop] if isinstance(run_stop, str) else list(run_stop or [])
    return own + [s for s in ACTION_STOPS if s not in own]


async def _observe(client: SearchClient, query: str, counts: Counter[str]) -> tuple[str, str]:
    """(observation, its text for the format check) of one search; a failure becomes `<error>`."""
    try:
        docs, cached = await client.search(query)
    except SearchError as e:
        counts["search_errors"] += 1
        # The first failure of a run is worth a warning; the rest are counted in extra_info.
        log.log(logging.WARNING if client.stats.errors == 1 else logging.DEBUG, "search %r failed: %s", query, e)
        error = f"<error>search failed: {e}</error>"
        # The model did its part; a broken retriever must not make its format wrong.
        return error, f"<information>{error}</information>"
    counts["searches"] += 1
    counts["search_cache_hits"] += int(cached)
    observation = information(docs)
    return observation, observation


async def run_rollout(item: dict[str, Any], ctx: RolloutContext) -> Trajectory:
    """Search and answer one question; reward by exact match, with partial credit for a well-formed try."""
    config, client = _run_state(ctx)
    golden = golden_answers(item)
    prompt = config.prompt_template.replace("{question}", question_text(item))
    conv = await ctx.conversation([{"role": "user", "content": prompt}])
    stops = _stops(ctx.run.sampling_params.get("stop"))
    transcript: list[str] = []
    counts: Counter[str] = Counter()
    answer: str | None = None
    finish = "stop"
    for turn in range(config.max_turns):
        before = len(conv.messages)
        finish = await ctx.generate(conv, return_logprob=config.return_logprob, stop=stops, no_stop_trim=True)
        if len(conv.messages) == before:  # the response budget was spent before this turn
            break
        text = conv.messages[-1]["content"]
        transcript.append(text)
        if finish != "stop":
            break
        action, content = parse_action(text)
        if action == "answer":
            answer = content
            break
        if turn + 1 == config.max_turns:
            break
        if action == "search":
            observation, checked = await _observe(client, content, counts)
        else:
            counts["invalid_actions"] += 1
            observation = checked = INVALID_ACTION_HINT
        transcript.append(checked)
        await conv.aadd_messages([{"role": "user", "content": observation}])
    well_formed = is_well_formed("\n".join(transcript))
    reward = search_reward(answer, golden, well_formed, config.format_score)
    extra: dict[str, Any] = {
        "golden_answers": golden, "answer": answer, "well_formed": well_formed,
        "searches": counts["searches"], "search_cache_hits": counts["search_cache_hits"],
        "search_errors": counts["search_errors"], "invalid_actions": counts["invalid_actions"],
    }
    if item.get("metadata") is not None:
        extra["metadata"] = item["metadata"]
    return await ctx.trajectory(conv, reward, finish, **extra)
