"""Images in, images trained: a Qwen-VL-style checkpoint made from files in the repository (`vision_checkpoint`),
the simulated engine checking each image's placeholder tokens as SGLang does and naming its colour (so a test sees
that the pixels reached it), and the buffer over real HTTP: a native vision run, a session per wire format with
the official clients, a screenshot loop resending its images, image URLs fetched only from allowed hosts, an OpenEnv
and a verifiers environment's image observations, bad images refused naming their part, a text model told of the
images it cannot see, the slime adapter's samples with their images, and a kill -9 with images stored."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import io
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from environment_venvs import OPENENV_ENVS, VERIFIERS_ENVS
from PIL import Image
from runs import drain, start, wait_finished, write_jsonl
from servers import Server, buffer_server, free_port, running, session_host, sim_engine
from sessions import finish, open_session, record

from rollout_buffer.delivery.retention import Retention
from rollout_buffer.delivery.store import Store
from rollout_buffer.media.image_fetch import fetch_image_bytes
from rollout_buffer.media.image_store import ImageStore
from rollout_buffer.media.vision import VisionProcessor
from rollout_buffer.tokens.tokenizer import load_tokenizer
from rollout_buffer.tools.export import export_to_file
from rollout_sim.vision_checkpoint import png, vision_checkpoint
from slime_adapter.client import BufferClient
from slime_adapter.records import SampleBuilder, open_image

RED, BLUE, GREEN = (220, 30, 30), (30, 60, 220), (30, 180, 60)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vision_checkpoint(tmp_path_factory.mktemp("vision") / "checkpoint")


@pytest.fixture(scope="module")
def vision(checkpoint: Path) -> VisionProcessor:
    found = VisionProcessor.of(checkpoint, load_tokenizer(str(checkpoint)))
    assert found is not None
    return found


@pytest.fixture(scope="module")
def engine(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("vision-sim"), str(checkpoint)) as srv:
        yield srv


def image_runs(rec: dict[str, Any], vision: VisionProcessor) -> list[int]:
    """The length of each run of image pads in a record's tokens, all at loss 0."""
    runs: list[int] = []
    for k, t in enumerate(rec["tokens"]):
        if t == vision.pad_id:
            assert rec["loss_mask"][k] == 0, f"{rec['uid']}: an image token at loss 1 (position {k})"
            if k and rec["tokens"][k - 1] == vision.pad_id:
                runs[-1] += 1
            else:
                runs.append(1)
    return runs


def assert_images(rec: dict[str, Any], vision: VisionProcessor, sizes: list[tuple[int, int]]) -> None:
    """The record lists its images in order, its tokens hold each one's tokens, its messages name them by hash."""
    assert [(i["width"], i["height"]) for i in rec["images"]] == sizes
    assert image_runs(rec, vision) == [vision.tokens(w, h) for w, h in sizes]
    named = [p["image"] for m in rec["messages"] if isinstance(m["content"], list) for p in m["content"]
             if p["type"] == "image"]
    assert named == [f"sha256:{i['sha256']}" for i in rec["images"]]


def test_a_native_vision_run_sends_the_pixels_and_keeps_exact_tokens(tmp_path: Path, engine: Server, checkpoint: Path,
                                                                    vision: VisionProcessor) -> None:
    rows = [{"instance_id": name, "prompt": "What colour is it?", "images": [data_url(png(colour, size))],
             "label": name} for name, colour, size in (("red", RED, (64, 48)), ("blue", BLUE, (1280, 800)))]
    with buffer_server(tmp_path) as buffer:
        start(buffer.url, engine.url, write_jsonl(tmp_path / "vision.jsonl", rows), str(checkpoint),
              task_type="vision", num_repeat_per_sample=2, max_tokens=32)
        status = wait_finished(buffer.url)
        records = drain(buffer.url)
        served = {i["sha256"]: httpx.get(f"{buffer.url}/images/{i['sha256']}", timeout=10) for r in records
                  for i in r["images"]}
        exported = export_to_file(tmp_path / "data", tmp_path / "export" / "run.jsonl")
        named_badly = httpx.get(f"{buffer.url}/images/not-a-hash", timeout=10)
        outside = httpx.get(f"{buffer.url}/images/..%2F..%2Fbuffer.sqlite", timeout=10)
        unknown = httpx.get(f"{buffer.url}/images/{'0' * 64}", timeout=10)
    assert status["run"]["progress"]["failed"] == 0
    assert len(records) == 4
    for rec in records:
        size = (64, 48) if rec["instance_id"] == "red" else (1280, 800)
        assert_images(rec, vision, [size])
        assert rec["raw_reward"] == 1.0 and rec["messages"][-1]["content"] == f"The image is {rec['instance_id']}."
    for sha, answer in served.items():
        assert answer.status_code == 200 and answer.headers["content-type"] == "image/png"
        assert hashlib.sha256(answer.content).hexdigest() == sha
        assert (tmp_path / "export" / "images" / f"{sha}.png").read_bytes() == answer.content  # beside the JSONL
    assert exported.records == 4 and exported.images == set(served)
    assert named_badly.status_code == 422 and "sha256" in named_badly.json()["message"]
    assert unknown.status_code == 404 and "sha256" in unknown.json()["message"]
    assert outside.status_code == 404 and b"SQLite" not in outside.content


def test_each_wire_format_takes_its_images(tmp_path: Path, engine: Server, checkpoint: Path,
                                          vision: VisionProcessor) -> None:
    """The official clients: an OpenAI chat `image_url` data URL, a Responses `input_image`, an Anthropic base64
    `image` block; each model turn sees its image, and each record holds it."""
    with session_host(tmp_path, engine.url, str(checkpoint), max_tokens=64) as buffer:
        chat = open_session(buffer.url, "chat")
        reply = openai.OpenAI(base_url=chat["base_url"], api_key=chat["api_key"]).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": [
                {"type": "text", "text": "Colour?"}, {"type": "image_url", "image_url": {"url": data_url(png(RED))}}]}])
        assert reply.choices[0].message.content == "The image is red."
        responses = open_session(buffer.url, "responses")
        answer = openai.OpenAI(base_url=responses["base_url"], api_key=responses["api_key"]).responses.create(
            model="policy", input=[{"role": "user", "content": [
                {"type": "input_text", "text": "Colour?"}, {"type": "input_image", "image_url": data_url(png(BLUE))}]}])
        assert answer.output_text == "The image is blue."
        claude = open_session(buffer.url, "anthropic")
        message = anthropic.Anthropic(base_url=claude["anthropic_base_url"], api_key=claude["api_key"]).messages.create(
            model="policy", max_tokens=64, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(png(GREEN)).decode()}},
                {"type": "text", "text": "Colour?"}]}])
        assert message.content[0].text == "The image is green."
        records = [record(buffer.url, uid) for s in (chat, responses, claude)
                   for uid in finish(buffer.url, s, 1.0)["uids"]]
    for rec in records:
        assert_images(rec, vision, [(64, 48)])


def test_a_screenshot_loop_resends_its_images_and_stays_one_branch(tmp_path: Path, engine: Server, checkpoint: Path,
                                                                   vision: VisionProcessor) -> None:
    """An agent that takes a screenshot each turn (a tool whose result is an image) and resends its whole history:
    the session goes on in one branch, each image's tokens stay where they were, and each image is stored once."""
    with session_host(tmp_path, engine.url, str(checkpoint), max_tokens=2048) as buffer:
        session = open_session(buffer.url, "screens")
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"])
        history: list[Any] = [{"role": "user", "content": "Watch the screen."}]
        colours = [RED, BLUE, GREEN, RED]  # the last screenshot is the first again: the same image, stored once
        for turn, colour in enumerate(colours):
            history.append({"role": "user", "content": [{"type": "text", "text": f"Screenshot {turn}:"},
                                                        {"type": "image_url",
                                                         "image_url": {"url": data_url(png(colour, (320, 200)))}}]})
            reply = client.chat.completions.create(model="policy", messages=history).choices[0].message.content
            history.append({"role": "assistant", "content": reply})
        uids = finish(buffer.url, session, 1.0)["uids"]
        [rec] = [record(buffer.url, uid) for uid in uids]
        stored = list((tmp_path / "data" / "images").glob("??/*"))
    assert rec["extra_info"]["turns"] == 4
    assert_images(rec, vision, [(320, 200)] * 4)
    assert [m["content"] for m in rec["messages"] if m["role"] == "assistant"] == [
        "The image is red.", "The image is blue.", "The image is green.", "The image is red."]
    assert len({i["sha256"] for i in rec["images"]}) == 3 and len(stored) == 3


def test_bad_images_are_refused_naming_their_part_and_the_session_goes_on(tmp_path: Path, engine: Server,
                                                                          checkpoint: Path) -> None:
    with session_host(tmp_path, engine.url, str(checkpoint), "--max-image-bytes", "4096") as buffer:
        session = open_session(buffer.url, "bad")
        url = f"{session['base_url']}/chat/completions"
        headers = {"authorization": f"Bearer {session['api_key']}"}
        big = io.BytesIO()
        Image.effect_noise((128, 128), 64).convert("RGB").save(big, format="PNG")
        for part, reason in (
                ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}, "not an image"),
                ({"type": "image_url", "image_url": {"url": "data:image/png;base64,???"}}, "not base64"),
                ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote image URL"),
                ({"type": "image_url", "image_url": {"url": data_url(big.getvalue())}}, "at most 4096")):
            answer = httpx.post(url, headers=headers, timeout=30, json={"model": "policy", "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}]})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert reason in error["message"] and error["param"] == "messages[0].content[1]", error
        ok = httpx.post(url, headers=headers, timeout=30, json={"model": "policy", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(BLUE))}}]}]})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "The image is blue."
        stored = list((tmp_path / "data" / "images").glob("??/*"))
    assert len(stored) == 1  # the good one alone


@contextmanager
def image_host(images: dict[str, bytes], host_headers: list[str] | None = None
               ) -> Iterator[tuple[str, list[str]]]:
    """An HTTP server on loopback serving `images` by path, `/moved` redirecting to the first; its URL and the paths
    it was asked for (and the `Host` header of each request in `host_headers`)."""
    asked: list[str] = []
    first = next(iter(images))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            if host_headers is not None:
                host_headers.append(self.headers["Host"])
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", first)
                self.end_headers()
                return
            body = images.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("workers", [0, 1], ids=["in-the-buffer", "on-a-session-worker"])
def test_an_image_url_is_fetched_only_from_a_host_the_operator_allows(tmp_path: Path, engine: Server,
                                                                      checkpoint: Path, vision: VisionProcessor,
                                                                      workers: int) -> None:
    """`--image-url-host 127.0.0.1`: an OpenAI `image_url` and an Anthropic `url` source on it are fetched (once,
    however often the history resends them); a redirect, a 404 and another host are 400s naming the part."""
    with image_host({"/red.png": png(RED), "/green.png": png(GREEN)}) as (host, asked), \
            session_host(tmp_path, engine.url, str(checkpoint), "--image-url-host", "127.0.0.1",
                         "--session-workers", str(workers), "--session-worker-port", str(free_port()),
                         max_tokens=64) as buffer:
        chat = open_session(buffer.url, "chat")
        client = openai.OpenAI(base_url=chat["base_url"], api_key=chat["api_key"])
        history: list[Any] = [{"role": "user", "content": [
            {"type": "text", "text": "Colour?"}, {"type": "image_url", "image_url": {"url": f"{host}/red.png"}}]}]
        for _ in range(2):
            reply = client.chat.completions.create(model="policy", messages=history)
            assert reply.choices[0].message.content == "The image is red."
            history += [{"role": "assistant", "content": reply.choices[0].message.content},
                        {"role": "user", "content": "And now?"}]
        claude = open_session(buffer.url, "anthropic")
        message = anthropic.Anthropic(base_url=claude["anthropic_base_url"], api_key=claude["api_key"]).messages.create(
            model="policy", max_tokens=64, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": f"{host}/green.png"}},
                {"type": "text", "text": "Colour?"}]}])
        assert message.content[0].text == "The image is green."
        url = f"{chat['base_url']}/chat/completions"
        for where, reason in ((f"{host}/moved", "answered 302"), (f"{host}/missing.png", "answered 404"),
                              (host.replace("127.0.0.1", "localhost") + "/red.png", "--image-url-host")):
            answer = httpx.post(url, headers={"authorization": f"Bearer {chat['api_key']}"}, timeout=30, json={
                "model": "policy", "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": where}}]}]})
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert reason in error["message"] and error["param"] == "messages[0].content[1]", error
        records = [record(buffer.url, uid) for s in (chat, claude) for uid in finish(buffer.url, s, 1.0)["uids"]]
    assert asked == ["/red.png", "/green.png", "/moved", "/missing.png"]  # each image fetched once, no redirect
    assert_images(records[0], vision, [(64, 48)])
    assert [i["sha256"] for r in records for i in r["images"]] == [hashlib.sha256(png(c)).hexdigest()
                                                                   for c in (RED, GREEN)]


def test_an_image_hosts_name_is_looked_up_once_and_may_not_lead_inside(monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: an allowed name that resolves to a loopback (private, link-local) address is refused unless
    that address is allowed too; the fetch goes to the address the check saw (a second lookup, which could answer
    another address, is never made) with the name as `Host`."""
    lookups: list[str] = []
    real = socket.getaddrinfo

    def resolve(name: str, *args: Any, **kwargs: Any) -> Any:
        if name != "images.test":
            return real(name, *args, **kwargs)
        lookups.append(name)
        if len(lookups) > 1:
            raise socket.gaierror("a second lookup")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", args[0]))]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    seen: list[str] = []
    with image_host({"/red.png": png(RED)}, seen) as (host, asked):
        port = int(host.rsplit(":", 1)[1])
        url = f"http://images.test:{port}/red.png"
        with pytest.raises(ValueError, match=r"resolves to 127\.0\.0\.1, a loopback, private or link-local"):
            asyncio.run(fetch_image_bytes(url, ("images.test",), 1 << 20))
        lookups.clear()
        assert asyncio.run(fetch_image_bytes(url, ("images.test", "127.0.0.1"), 1 << 20)) == png(RED)
    assert lookups == ["images.test"] and asked == ["/red.png"] and seen == [f"images.test:{port}"]


def test_an_openenv_environments_image_observations_reach_the_model(tmp_path: Path, engine: Server,
                                                                     checkpoint: Path, vision: VisionProcessor,
                                                                     openenv_python: str) -> None:
    """OpenEnv's own server library (`colour_cards.py`): each observation's `image` field is shown with its text;
    the model names each card's colour (the pixels reached it), the environment scores that, and the record holds
    both cards' tokens in the order they were shown, at loss 0."""
    resets = [{"seed": 1}, {"seed": 2}]
    with buffer_server(tmp_path) as buffer:
        answer = httpx.post(f"{buffer.url}/start_rollout", timeout=120, json={
            "task_type": "openenv", "remote_engine_url": engine.url, "tokenizer_path": str(checkpoint),
            "num_repeat_per_sample": 1, "max_tokens": 64, "openenv_resets": resets,
            "openenv_image_field": "image",
            "openenv_command": [openenv_python, str(OPENENV_ENVS / "colour_cards.py"), "--port", "{port}"]})
        assert answer.status_code == 200, answer.text
        status = wait_finished(buffer.url, timeout_s=300)
        records = drain(buffer.url)
    assert status["run"]["progress"]["statuses"] == {"completed": 2}, status["run"]["progress"]
    for rec in records:
        assert rec["raw_reward"] == 2.0 and rec["extra_info"]["openenv"]["step_rewards"] == [1.0, 1.0]
        assert_images(rec, vision, [(64, 48), (64, 48)])
        said = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        assert len(said) == 2 and all(s.startswith("The image is ") for s in said)


def test_a_verifiers_environments_image_prompts_reach_the_model(tmp_path: Path, engine: Server, checkpoint: Path,
                                                                 vision: VisionProcessor, verifiers_python: str
                                                                 ) -> None:
    """verifiers' own `image_url` content parts (`rb_colours.py`): the environment's prompt images go through the
    session's chat endpoint to the model, which names each card's colour, and the environment scores it."""
    with buffer_server(tmp_path) as buffer:
        answer = httpx.post(f"{buffer.url}/start_rollout", timeout=600, json={
            "task_type": "verifiers", "remote_engine_url": engine.url, "tokenizer_path": str(checkpoint),
            "env_python": verifiers_python, "env_id": "rb_colours", "env_paths": [str(VERIFIERS_ENVS)],
            "env_config": {"agent": {"harness": {"id": "null"}}}, "num_repeat_per_sample": 1, "max_tokens": 64})
        assert answer.status_code == 200, answer.text
        status = wait_finished(buffer.url, timeout_s=300)
        records = drain(buffer.url)
    assert status["run"]["progress"]["statuses"] == {"completed": 2}, status["run"]["progress"]
    for rec in records:
        colour = rec["instance_id"].removeprefix("card-")
        assert rec["raw_reward"] == 1.0 and colour in rec["messages"][-1]["content"]
        assert_images(rec, vision, [(64, 48)])


def test_a_text_model_is_sent_a_placeholder_and_its_record_says_so(tmp_path: Path, qwen_tokenizer_path: str) -> None:
    with sim_engine(tmp_path, qwen_tokenizer_path) as text_engine, \
            session_host(tmp_path, text_engine.url, qwen_tokenizer_path) as buffer:
        session = open_session(buffer.url, "text")
        openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"]).chat.completions.create(
            model="policy", messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is 2 + 2?"},
                {"type": "image_url", "image_url": {"url": data_url(png(RED))}}]}])
        [uid] = finish(buffer.url, session, 1.0)["uids"]
        rec = record(buffer.url, uid)
    assert rec["extra_info"]["images_omitted"] == 1 and "images" not in rec
    assert rec["messages"][0]["content"] == "What is 2 + 2?\n[image omitted]"


def test_a_vision_run_without_exact_tokens_fails_saying_why(tmp_path: Path, engine: Server) -> None:
    """Chat mode (no tokenizer_path) keeps no images: each trajectory of a vision run fails naming that, rather
    than sending the engine a prompt whose images went nowhere."""
    rows = [{"instance_id": "red", "prompt": "Colour?", "images": [data_url(png(RED))], "label": "red"}]
    with buffer_server(tmp_path) as buffer:
        start(buffer.url, engine.url, write_jsonl(tmp_path / "vision.jsonl", rows), None, task_type="vision",
              num_repeat_per_sample=1, max_tokens=32, max_retries=0)
        status = wait_finished(buffer.url)
        rec = httpx.get(f"{buffer.url}/trajectories/{status['run']['run_id']}:red:0:0", timeout=10).json()
    assert status["run"]["progress"]["failures"] == {"generator_error": 1}, status["run"]["progress"]
    assert rec["status"] == "failed" and "keeps none here" in rec["extra_info"]["error"], rec


def test_a_teachers_log_probs_of_a_vision_trajectory_see_its_images(tmp_path: Path, engine: Server,
                                                                    checkpoint: Path) -> None:
    """`teacher_engine_url`: the teacher is asked with the trajectory's images beside its tokens (one pad each) and
    gives a log-prob for each response token (`tests/test_real_sglang.py` holds the values against a forward with
    the images)."""
    rows = [{"instance_id": "red", "prompt": "Colour?", "images": [data_url(png(RED, (320, 200)))], "label": "red"}]
    with buffer_server(tmp_path) as buffer:
        start(buffer.url, engine.url, write_jsonl(tmp_path / "vision.jsonl", rows), str(checkpoint),
              task_type="vision", num_repeat_per_sample=1, max_tokens=32, teacher_engine_url=engine.url)
        status = wait_finished(buffer.url)
        [rec] = drain(buffer.url)
    assert status["run"]["progress"]["failed"] == 0, status["run"]["progress"]
    assert len(rec["teacher_log_probs"]) == rec["response_length"] > 0
    assert all(lp <= 0 for lp in rec["teacher_log_probs"])


def test_an_engine_that_expands_images_otherwise_fails_the_trajectory(tmp_path: Path, engine: Server,
                                                                     checkpoint: Path) -> None:
    """The run's `tokenizer_path` allows fewer pixels an image than the engine's checkpoint: the engine reads the
    prompt as more tokens than the buffer holds, and the trajectory fails naming why, rather than being stored with
    tokens the engine did not generate from."""
    other = vision_checkpoint(tmp_path / "other")
    config = json.loads((other / "preprocessor_config.json").read_text())
    (other / "preprocessor_config.json").write_text(json.dumps({**config, "max_pixels": 28 * 28 * 16}))
    rows = [{"instance_id": "red", "prompt": "Colour?", "images": [data_url(png(RED, (640, 400)))], "label": "red"}]
    with buffer_server(tmp_path) as buffer:
        start(buffer.url, engine.url, write_jsonl(tmp_path / "vision.jsonl", rows), str(other), task_type="vision",
              num_repeat_per_sample=1, max_tokens=32, max_retries=0)
        status = wait_finished(buffer.url)
        rec = httpx.get(f"{buffer.url}/trajectories/{status['run']['run_id']}:red:0:0", timeout=10).json()
    assert rec["status"] == "failed", rec
    assert rec["extra_info"]["error_kind"] == "engine_image_tokens", rec["extra_info"]
    assert "expanded the images to other counts" in rec["extra_info"]["error"], rec["extra_info"]


def test_the_engine_expands_each_images_pad_as_sglang_does(engine: Server, checkpoint: Path,
                                                          vision: VisionProcessor) -> None:
    """As real SGLang 0.5.23 (`tests/test_real_sglang.py` holds the two side by side): one pad per image, expanded
    by the engine to the image's tokens (`prompt_tokens` counts them); more pads than images (an expanded prompt
    among them) is a 400; an image beyond the pads is left out."""
    ids = load_tokenizer(str(checkpoint)).encode("Look: ", add_special_tokens=False)
    block = [vision.start_id, vision.pad_id, vision.end_id]

    def generate(prompt: list[int], colours: list[tuple[int, int, int]]) -> httpx.Response:
        return httpx.post(f"{engine.url}/generate", timeout=30, json={
            "input_ids": prompt, "image_data": [data_url(png(c)) for c in colours],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0}})

    answer = generate([*ids, *block, *block], [RED, BLUE])
    assert answer.status_code == 200, answer.text
    assert answer.json()["meta_info"]["prompt_tokens"] == len(ids) + 2 * (vision.tokens(64, 48) + 2)
    assert "blue" in answer.json()["text"]  # the model looks at the last image
    for prompt, colours in (([*ids, *block, *block], [RED]),
                            ([*ids, vision.start_id, *[vision.pad_id] * vision.tokens(64, 48), vision.end_id], [RED])):
        refused = generate(prompt, colours)
        assert refused.status_code == 400, refused.text
        assert "image placeholders but 1 image inputs" in refused.json()["error"]["message"]
    answer = generate([*ids, *block], [RED, BLUE])
    assert answer.status_code == 200 and "red" in answer.json()["text"], answer.text


def test_the_adapters_samples_carry_the_pixels_the_engine_saw(tmp_path: Path, engine: Server, checkpoint: Path,
                                                              vision: VisionProcessor) -> None:
    """slime's `multimodal_inputs` (the images, in order) and `multimodal_train_inputs` (the checkpoint's image
    processor's `pixel_values` and `image_grid_thw`, whose patches are the tokens the record holds)."""
    pytest.importorskip("torch")  # the image processor's outputs are tensors
    from transformers import AutoImageProcessor

    rows = [{"instance_id": "red", "prompt": "Colour?", "images": [data_url(png(RED, (320, 200)))], "label": "red"}]
    with buffer_server(tmp_path) as buffer:
        start(buffer.url, engine.url, write_jsonl(tmp_path / "vision.jsonl", rows), str(checkpoint),
              task_type="vision", num_repeat_per_sample=2, max_tokens=32)
        wait_finished(buffer.url)
        records = drain(buffer.url)
        with BufferClient(buffer.url) as client:
            processor = AutoImageProcessor.from_pretrained(str(checkpoint))
            builder = SampleBuilder(lambda: None, "qwen3", image=lambda sha: open_image(client.image(sha)),
                                    image_processor=lambda: processor)
            samples = [builder.build(r) for r in records]
    for sample, rec in zip(samples, records, strict=True):
        [image] = sample.multimodal_inputs["images"]
        assert image.size == (320, 200) and image.getpixel((5, 5)) == RED
        grid = sample.multimodal_train_inputs["image_grid_thw"].tolist()
        assert grid == [list(vision.grid(320, 200))]
        assert image_runs(rec, vision) == [grid[0][1] * grid[0][2] // 4]


def test_a_session_with_images_survives_a_kill9(tmp_path: Path, engine: Server, checkpoint: Path,
                                                vision: VisionProcessor) -> None:
    """Its images are stored before its turn is answered: after a kill -9 and a restart the session goes on at
    the same URL from the same tokens, the image resent continuing its branch."""
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    payload = {"task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": str(checkpoint)}
    first = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                          {"type": "image_url", "image_url": {"url": data_url(png(RED))}}]}]
    with running(args, "/healthz", port, tmp_path / "buffer.log") as buffer:
        httpx.post(f"{buffer.url}/start_rollout", json=payload, timeout=30).raise_for_status()
        session = open_session(buffer.url, "survivor")
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"])
        reply = client.chat.completions.create(model="policy", messages=first).choices[0].message.content
        buffer.kill9()
    with running(args, "/healthz", port, tmp_path / "buffer2.log") as buffer:
        second = [*first, {"role": "assistant", "content": reply},
                  {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(BLUE))}}]}]
        assert client.chat.completions.create(model="policy", messages=second).choices[0].message.content == \
            "The image is blue."
        [rec] = [record(buffer.url, uid) for uid in finish(buffer.url, session, 1.0)["uids"]]
        assert httpx.get(f"{buffer.url}/images/{rec['images'][0]['sha256']}", timeout=10).status_code == 200
    assert rec["extra_info"]["turns"] == 2
    assert_images(rec, vision, [(64, 48), (64, 48)])


def test_retention_deletes_the_images_only_pruned_records_held(tmp_path: Path, engine: Server,
                                                               checkpoint: Path) -> None:
    """Sessions on a session worker: once a delivered session's record is cut down to its facts, the image only it
    held goes (nothing uses it any more); the images a record still waiting for the trainer holds stay, served."""
    data = tmp_path / "data"
    with session_host(tmp_path, engine.url, str(checkpoint), "--session-workers", "1", "--group-size", "1",
                      "--session-worker-port", str(free_port()), max_tokens=64) as buffer:
        for name, colours in (("seen", (RED, BLUE)), ("waiting", (BLUE, GREEN))):
            session = open_session(buffer.url, name)
            client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"])
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(png(c))}} for c in colours]}])
            [uid] = finish(buffer.url, session, 1.0)["uids"]
            assert len(record(buffer.url, uid)["images"]) == 2
            if name == "seen":
                assert [r["uid"] for r in drain(buffer.url)] == [uid]

    async def prune() -> int:
        store = Store(data / "buffer.sqlite")
        await store.open()
        try:  # the retention pass `serve --prune-delivered-after-h` runs, due now
            return await Retention(store, 0.0, ImageStore(data / "images"), image_grace_s=0.0).prune()
        finally:
            await store.close()

    assert asyncio.run(prune()) == 1
    shas = {c: hashlib.sha256(png(c)).hexdigest() for c in (RED, BLUE, GREEN)}
    with buffer_server(tmp_path) as buffer:
        served = {c: httpx.get(f"{buffer.url}/images/{sha}", timeout=10).status_code for c, sha in shas.items()}
    assert served == {RED: 404, BLUE: 200, GREEN: 200}
