"""Runs and evaluations: `/start_rollout` (a run, or evals with `mode: "eval"`), `/start_eval`, `/eval_results`.
Both starts resolve their settings and input the same way (`resolved_input`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response
from pydantic import TypeAdapter

from rollout_buffer.config import ServerConfig
from rollout_buffer.generation.evaluation import EvalManager, eval_config
from rollout_buffer.generation.inputs import InputFileError, resolve_input_path, validate_file, write_default_input
from rollout_buffer.generation.options import check_engine_options, engines_for_signals, run_option_defaults
from rollout_buffer.generation.plugins import Generator
from rollout_buffer.generation.run_health import RunHealthOptions
from rollout_buffer.generation.run_manager import RunManager, reads_input
from rollout_buffer.generation.run_policy import check_run
from rollout_buffer.policy import PolicyRefused
from rollout_buffer.schemas import EvalResultsRequest, StartEvalRequest, StartRolloutRequest
from rollout_buffer.server.bodies import component, documented_body, json_response, parse_body, validated
from rollout_buffer.tokens.tokenizer import hub_id_hint, load_tokenizer, looks_like_hub_id

log = logging.getLogger(__name__)

START_BODY: TypeAdapter[StartRolloutRequest] = TypeAdapter(StartRolloutRequest)
EVAL_BODY: TypeAdapter[StartEvalRequest] = TypeAdapter(StartEvalRequest)

router = APIRouter()


@router.post(
    "/start_rollout",
    summary="Start (or replace) the rollout run; with mode \"eval\", start evals (as /start_eval)",
    # Parsed by hand: the body is a rollout payload or, with `mode: "eval"`, an eval payload.
    openapi_extra=documented_body(
        {"anyOf": [component(StartRolloutRequest), component(StartEvalRequest)]}, True),
)


async def start_rollout(request: Request) -> Response:
    config: ServerConfig = request.app.state.config
    generators: dict[str, Generator] = request.app.state.generators
    body = parse_body(await request.body())
    if isinstance(body, dict) and body.get("mode") == "eval":
        return await _start_eval(validated(EVAL_BODY, body), request)
    req: StartRolloutRequest = validated(START_BODY, body)
    gen = generators.get(req.task_type)
    if gen is None:
        raise HTTPException(422, f"task_type: unknown {req.task_type!r}; known: {sorted(generators)}")
    if not gen.native:
        for name in ("max_staleness", "max_ready_groups", "regenerate_stale"):
            if getattr(req, name):
                raise HTTPException(422, f"{name}: needs a native generator (run_rollout(item, ctx)); "
                                         f"{req.task_type!r} posts its own records")
    runs: RunManager = request.app.state.runs
    try:
        payload, path, num_items = await resolved_input(request, gen, req.model_dump(mode="json"), "input_file")
        if not req.engine_urls():  # every run has an engine client: without one, it would fail once started
            raise ValueError("remote_engine_url: required: the policy engine the run generates with (an SGLang "
                             "server's URL, a list of them, or an sglang-router's)")
        await runs.executor.check_options(payload)
        RunHealthOptions.from_run(payload)
        # Routed experts and top-p kept ids are asked of a router's workers; the engines' context length, keys a
        # router would drop; engines that do not answer (yet).
        payload, signal_warnings = await engines_for_signals(payload)
        engine_warnings = [*signal_warnings, *await check_engine_options(payload)]
    except ValueError as e:  # InputFileError included
        raise HTTPException(422, str(e)) from None
    # A run that only hosts sessions groups them like /buffer/write records unless told otherwise.
    group_size = config.group_size if path is None and "num_repeat_per_sample" not in req.model_fields_set else None
    req = START_BODY.validate_python(payload)  # with the sandbox settings the policy filled in
    run_id = await runs.start(req, path, num_items, group_size)
    message = (f"rollout started for {num_items} tasks" if path is not None
               else "agent run started: open sessions with POST /sessions")
    answer = {"success": True, "message": message, "run_id": run_id, "num_items": num_items}
    if warnings := [*engine_warnings, *req.near_misses(run_option_defaults())]:
        for warning in warnings:
            log.warning("run %s: %s", run_id, warning)
        answer["warnings"] = warnings
    return json_response(answer)


async def resolved_input(request: Request, gen: Generator, payload: dict[str, Any], input_field: str,
                         evaluating: bool = False) -> tuple[dict[str, Any], Path | None, int]:
    """A run's or an eval's settings judged by the server's policy (PolicyRefused: 403) and the generator's own
    checks, with its input file: the one named (which must exist), the generator's own listing, or none (a run
    that only hosts sessions). ValueError naming what is wrong (422). The one input resolution of runs and evals."""
    config: ServerConfig = request.app.state.config
    try:
        payload = {**payload, **check_run(payload, config.policy, gen.module)}
    except PolicyRefused as e:
        if e.option == "tokenizer_path" and looks_like_hub_id(str(payload["tokenizer_path"])):
            raise ValueError(hub_id_hint(str(payload["tokenizer_path"]))) from None
        raise
    check = gen.hook("check_payload")
    if check is not None:  # the generator's own options (it may resolve files: off the loop)
        await asyncio.to_thread(check, payload, config.policy)
    tokenizer = payload.get("tokenizer_path")
    if tokenizer and payload.get("engine_mode") != "chat":  # a run's exact tokens need it to load
        try:
            await asyncio.to_thread(load_tokenizer, str(tokenizer))
        except ValueError as e:
            hint = f"; {hub_id_hint(str(tokenizer))}" if looks_like_hub_id(str(tokenizer)) else ""
            raise ValueError(f"tokenizer_path: {e}{hint}") from None
    if not reads_input(gen, payload):
        return payload, None, 0
    runs: RunManager = request.app.state.runs
    listing = gen.hook("default_input")
    if payload.get("input_file") is None and listing is not None:  # the generator's own dataset
        rows = await listing(payload, True if evaluating else runs.runs_here(gen, payload))
        path = await asyncio.to_thread(write_default_input, config.data_dir, str(payload["task_type"]), rows)
    elif payload.get("input_file") is None:
        raise InputFileError(f"{input_field}: required for task_type {payload['task_type']!r} (only an agent "
                             "run that hosts sessions, without agent or agent_command, runs without)")
    else:
        path = await asyncio.to_thread(resolve_input_path, str(payload["input_file"]), input_field)
    num_items = (await asyncio.to_thread(validate_file, path, gen.required_fields)).num_items
    return payload, path, num_items


@router.post("/start_eval", summary="Evaluate named datasets at a trainer version, beside the training run")
async def start_eval(req: StartEvalRequest, request: Request) -> Response:
    return await _start_eval(req, request)


async def _start_eval(req: StartEvalRequest, request: Request) -> Response:
    config: ServerConfig = request.app.state.config
    generators: dict[str, Generator] = request.app.state.generators
    evals: EvalManager = request.app.state.evals
    base = await evals.base_config()
    version = await evals.version_for(req)
    resolved: dict[str, tuple[Path, int, dict[str, Any]]] = {}
    for name, spec in req.datasets().items():
        cfg = eval_config(base, req, name, version)
        task = cfg.get("task_type")
        gen = generators.get(task or "")
        if gen is None:
            raise HTTPException(422, f"task_type: unknown {task!r}; known: {sorted(generators)}" if task else
                                "task_type: required (there is no run to take it from)")
        if not gen.native:
            raise HTTPException(422, f"task_type: evals need a native generator (run_rollout(item, ctx)); "
                                     f"{task!r} posts its own records")
        if not cfg.get("remote_engine_url"):
            raise HTTPException(422, "remote_engine_url: required (there is no run to take it from)")
        try:
            if spec.path is not None:
                config.policy.readable(f"eval_datasets.{name}.path", spec.path)
            elif gen.hook("default_input") is None:
                raise ValueError(f"path: required for task_type {task!r} (it has no input of its own)")
            cfg, path, num_items = await resolved_input(request, gen, {**cfg, "input_file": spec.path}, "path",
                                                        evaluating=True)
        except PolicyRefused as e:
            e.args = (f"eval_datasets.{name}: {e}",)
            raise
        except ValueError as e:  # InputFileError included
            raise HTTPException(422, f"eval_datasets.{name}: {e}") from None
        assert path is not None
        resolved[name] = (path, num_items, cfg)
    started = await evals.start(version, resolved, req.eval_num_process)
    return json_response({"success": True, "message": f"{len(started)} evals at version {version}",
                          "version": version, "evals": started})


@router.post("/eval_results", summary="Eval summaries (and records), waiting until the evals finish")
async def eval_results(req: EvalResultsRequest, request: Request) -> Response:
    evals: EvalManager = request.app.state.evals
    found = await evals.results(req.version, req.datasets, req.wait_s)
    if req.datasets is not None:
        missing = sorted(set(req.datasets) - {s.dataset for s in found})
        if missing and req.version is not None:
            raise HTTPException(404, f"datasets: no eval of {missing} at version {req.version}")
    results: dict[str, Any] = {}
    for summary in found:
        entry = summary.as_dict()
        if req.records:
            blobs = await evals.evals.records((summary.dataset, summary.version), summary.n_samples)
            entry["records"] = [orjson.Fragment(b) for b in blobs]
        results.setdefault(summary.dataset, entry)
    finished = bool(found) and all(s.state != "running" for s in found)
    return json_response({"success": finished, "finished": finished, "results": results})
