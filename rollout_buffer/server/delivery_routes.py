"""slime's delivery protocol: `/buffer/write`, `/get_rollout_data` (whole groups, long-poll, lease/ack), `/ack`,
`/trainer_version`; and what was stored, for inspection: `/trajectories/{uid}`, `/images/{sha256}` (the images records
name), `/groups`."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import orjson
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import Response
from pydantic import TypeAdapter

from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.streams import DEFAULT_STREAM
from rollout_buffer.generation.run_manager import RunManager
from rollout_buffer.media.image_store import ImageStore
from rollout_buffer.schemas import AckRequest, GetRolloutDataRequest, TrainerVersionRequest, TrajectoryRecord
from rollout_buffer.server.bodies import component, documented_body, json_response, parse_body, validated

# `/buffer/write` takes one record, or a list of records written in one transaction.
WRITE_BODY: TypeAdapter[TrajectoryRecord | list[TrajectoryRecord]] = TypeAdapter(
    TrajectoryRecord | list[TrajectoryRecord]
)
GET_BODY: TypeAdapter[GetRolloutDataRequest] = TypeAdapter(GetRolloutDataRequest)

router = APIRouter()


@router.post(
    "/buffer/write",
    summary="Persist one trajectory, or a list written together (idempotent on uid)",
    # Parsed by hand with orjson: FastAPI's body handling (stdlib json, dependency solving) cost more
    # CPU than storing the record. The schema is documented all the same.
    openapi_extra=documented_body(
        {"anyOf": [component(TrajectoryRecord), {"type": "array", "items": component(TrajectoryRecord)}]}, True),
)


async def buffer_write(request: Request) -> Response:
    body = validated(WRITE_BODY, parse_body(await request.body()))
    # A list is one transaction: how a multi-agent episode (records sharing extra_info.episode_id) must
    # arrive, so its group cannot complete with only part of the episode stored.
    records = body if isinstance(body, list) else [body]
    if not records:
        raise HTTPException(422, "body: an empty list writes nothing")
    buffer: RolloutBuffer = request.app.state.buffer
    result = await buffer.write(records)
    answer: dict[str, Any] = {
        "success": True,
        "message": f"{result.inserted} written, {result.duplicates} duplicate uids ignored",
        "written": result.inserted,
        "duplicates": result.duplicates,
    }
    if not isinstance(body, list):
        answer |= {"uid": body.uid, "duplicate": bool(result.duplicates)}
    return json_response(answer)


@router.post(
    "/get_rollout_data",
    summary="Whole ready groups, oldest first (long-poll, lease/ack)",
    # The body is parsed by hand (slime may send none at all); document its schema anyway.
    openapi_extra=documented_body(component(GetRolloutDataRequest), required=False),
)


async def get_rollout_data(request: Request) -> Response:
    # slime's original client may send an empty body: treat it as {}.
    raw = await request.body()
    body = parse_body(raw) if raw.strip() else {}
    req = validated(GET_BODY, body)
    buffer: RolloutBuffer = request.app.state.buffer
    runs: RunManager = request.app.state.runs
    if req.run_id is not None and await buffer.runs.get(req.run_id) is None:
        raise HTTPException(404, f"run_id: no run {req.run_id!r}")
    d = await buffer.deliver(req.max_groups, req.wait_s, req.lease_s, req.ack, request.is_disconnected,
                             order=req.order, current_version=req.current_version,
                             stream=req.agent_id or DEFAULT_STREAM, run_id=req.run_id)
    if d.meta_info and (admission := runs.admission()) is not None:
        d.meta_info |= {"admission_state": admission["state"], "groups_ahead": admission["groups_ahead"]}
    if d.meta_info and (weights := runs.weights()) is not None:
        d.meta_info["unversioned_weight_swaps"] = weights["unversioned_swaps"]
    message = f"{d.meta_info['num_groups']} groups" if d.success else "no complete group is ready"
    if not d.success and (run := await buffer.runs.get(req.run_id) if req.run_id else await buffer.runs.latest()
                          ) is not None and run.state == "failed":
        message += f"; run {run.run_id} failed: {run.error}"  # a trainer polling on learns why nothing comes
    return json_response(
        {"success": d.success, "message": message,
         # The stored JSON goes out as it is: parsing and re-encoding long token lists costs seconds.
         "data": {"data": [orjson.Fragment(r.blob) for r in d.records], "meta_info": d.meta_info}}
    )


@router.post("/ack", summary="Acknowledge a leased batch")
async def ack(req: AckRequest, request: Request) -> Response:
    buffer: RolloutBuffer = request.app.state.buffer
    n = await buffer.ack(req.batch_id, req.agent_id or DEFAULT_STREAM)
    if n is None:
        raise HTTPException(404, f"batch_id: no batch {req.batch_id!r} was delivered")
    return json_response({"success": True, "acked_groups": n})


@router.post("/trainer_version", summary="The trainer's weight version (it updated weights without fetching)")
async def trainer_version(req: TrainerVersionRequest, request: Request) -> Response:
    buffer: RolloutBuffer = request.app.state.buffer
    reported = await buffer.report_version(req.current_version, req.rewind, req.agent_id or DEFAULT_STREAM)
    if reported is None:
        raise HTTPException(409, "current_version: there is no rollout run yet to version (start one first; "
                                 "its start payload may carry current_version)")
    run_id, version = reported
    return json_response({"success": True, "run_id": run_id, "trainer_version": version.current,
                          "base_version": version.base, **({"agent_id": req.agent_id} if req.agent_id else {})})


# `:path`: a uid holds its instance id, which may hold '/'.
@router.get("/trajectories/{uid:path}", summary="One stored trajectory")
async def trajectory(uid: str, request: Request) -> Response:
    buffer: RolloutBuffer = request.app.state.buffer
    rec = await buffer.get_record(uid)
    if rec is None:
        raise HTTPException(404, f"uid: no trajectory {uid!r}")
    return json_response(rec)


@router.get("/images/{sha256}", summary="An image a record names, by its SHA-256",
            responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}}})
async def image(request: Request, sha256: str = PathParam(pattern="^[0-9a-f]{64}$")) -> Response:
    config: ServerConfig = request.app.state.config
    found = await asyncio.to_thread(ImageStore(config.image_dir).get, sha256)
    if found is None:
        raise HTTPException(404, f"sha256: no image {sha256}")
    # Immutable: its name is its content's hash.
    return Response(found.data, media_type=found.media_type,
                    headers={"cache-control": "private, max-age=31536000, immutable"})


@router.get("/groups", summary="Groups by state, newest first (inspection)")
async def groups(
    request: Request,
    state: Literal["open", "complete", "ready", "leased", "delivered", "filtered"] | None = None,
    run_id: str | None = None,
    limit: int = Query(default=100, ge=1, le=10_000),
) -> Response:
    buffer: RolloutBuffer = request.app.state.buffer
    return json_response({"groups": await buffer.reads.list_groups(state, run_id, limit)})
