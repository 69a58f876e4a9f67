"""The dashboard (`GET /ui`) in a real headless Chromium (Debian's package, driven by Playwright) on a live
buffer behind --auth-token with a simulated math rollout running: the run and its moving counts, the token
view's loss-mask styling, a rejected token; the charts (titles, axes with units, labels off the line, "no data
yet", scaled to the current run), run ids on one line, long messages collapsed, a page load without an error;
a record's images in place; and its read-only API over HTTP (auth, paging, filters, 422s)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from ops_helpers import math_rows, scrape, start_run, write_jsonl
from servers import Server, free_port, free_ports, running
from servers import sim_engine as start_sim_engine

from rollout_sim.vision_checkpoint import png, vision_checkpoint

CHROMIUM = os.environ.get("RB_CHROMIUM", "/usr/bin/chromium")
TOKEN = "ui-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ARTIFACTS = Path(__file__).parent / "artifacts"
# The line charts and the unit of their y axis.
UNITS = {"reward": "reward (raw)", "throughput": "trajectories/s", "inflight": "trajectories", "lag": "versions",
         "latency": "ms"}



@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory, qwen_tokenizer_path: str) -> Iterator[Server]:
    # 150 ms a request and 4 in flight: the 320-trajectory run lasts about 12 s, long enough to watch.
    with start_sim_engine(tmp_path_factory.mktemp("sim"), qwen_tokenizer_path, "--latency-ms", "150") as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory) -> Iterator[Server]:
    with own_buffer(tmp_path_factory.mktemp("buffer")) as srv:
        yield srv


@contextmanager
def own_buffer(tmp: Path) -> Iterator[Server]:
    """A buffer on a store of its own in `tmp`, behind the token."""
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp / "data"), "--auth-token", TOKEN]
    with running(args, "/healthz", port, tmp / "buffer.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def run_id(buffer: Server, sim_engine: Server, qwen_tokenizer_path: str, tmp_path_factory) -> str:
    data = write_jsonl(tmp_path_factory.mktemp("data") / "math.jsonl", math_rows(80))
    return start_run(buffer.url, sim_engine.url, data, qwen_tokenizer_path, headers=AUTH, num_process=4)


@pytest.fixture(scope="module")
def session_uids(buffer: Server, run_id: str, qwen_tokenizer) -> list[str]:
    """A capture-proxy session's records as `/buffer/write` takes them: branch 1 forked from branch 0 at turn 1,
    exact tokens with weight versions and a tokenization-check report; with two more records the group of 4
    completes (and is normalized)."""
    prompt = qwen_tokenizer.encode("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    records = []
    for k in range(4):
        response = qwen_tokenizer.encode(f"It is {4 + k}.<|im_end|>")
        info: dict = {"epoch": 0, "weight_version_spans": [[len(prompt), len(prompt) + len(response), "7"]]}
        if k < 2:
            info |= {"session_id": "sess-abc", "branch": k, "parent_branch": None if k == 0 else 0, "fork_turn": k,
                     "agent_id": "solver"}
        if k == 1:
            info["tokenization_mismatch"] = {"mode": "strict", "unit": "token", "position": len(prompt) + 1}
        records.append({
            "uid": f"ui-session-{k}", "instance_id": "ui-session", "reward": float(k == 0),
            "messages": [{"role": "user", "content": "What is 2 + 2?"},
                         {"role": "assistant", "content": f"It is {4 + k}."}],
            "tokens": prompt + response, "loss_mask": [0] * len(prompt) + [1] * len(response),
            "rollout_log_probs": [-0.25] * len(response), "response_length": len(response), "extra_info": info,
        })
    resp = httpx.post(f"{buffer.url}/buffer/write", json=records, headers=AUTH, timeout=30)
    assert resp.status_code == 200, resp.text
    return [r["uid"] for r in records]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    # Only the browser tests need these; the API tests run without them.
    if shutil.which(CHROMIUM) is None:
        pytest.skip(f"no chromium at {CHROMIUM} (Debian: apt-get install chromium; .ci/run does)")
    playwright_sync = pytest.importorskip("playwright.sync_api")
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield b
        b.close()


@pytest.fixture
def page(browser) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    pg = context.new_page()
    pg.set_default_timeout(15_000)
    yield pg
    context.close()


def connect(page, buffer: Server, token: str) -> None:
    page.goto(f"{buffer.url}/ui")
    page.fill("#token", token)
    page.click("#auth button")


def test_the_page_loads_without_a_token_and_its_api_needs_the_right_one(buffer: Server) -> None:
    page = httpx.get(f"{buffer.url}/ui", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    head = page.text.split("<body>")[0]
    # No CDN: nothing in the head is fetched from another host (the inline icon's SVG namespace is no fetch).
    assert 'src="/ui/static/app.js"' in page.text and not re.search(r"""(?:src|href)=["']?(?:https?:)?//""", head)
    assert httpx.get(f"{buffer.url}/ui/static/app.js", timeout=10).status_code == 200
    assert httpx.get(f"{buffer.url}/ui/api/runs", timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(f"{buffer.url}/ui/api/runs", headers=wrong, timeout=10).status_code == 401
    assert httpx.get(f"{buffer.url}/ui/api/runs", headers=AUTH, timeout=10).status_code == 200
    # A path that merely starts like the public assets reaches nothing but them (no data without a token).
    sneaky = httpx.get(f"{buffer.url}/ui/static/%2e%2e/api/runs", timeout=10)
    assert sneaky.status_code == 404 and "runs" not in sneaky.text


def test_a_wrong_token_is_rejected_in_the_browser(page, buffer: Server, run_id: str) -> None:
    statuses: list[int] = []
    page.on("response", lambda r: statuses.append(r.status) if "/ui/api/" in r.url else None)
    connect(page, buffer, "wrong-token")
    page.wait_for_selector("#error:not([hidden])")
    assert "401" in page.inner_text("#error")
    assert page.inner_text("#conn") == "rejected"
    assert 401 in statuses and 200 not in statuses
    assert page.inner_text("#run-head") == "no run yet"  # nothing of the run was shown


def test_the_run_shows_and_its_counts_move_live(page, buffer: Server, run_id: str) -> None:
    connect(page, buffer, TOKEN)
    page.wait_for_function("id => document.querySelector('#run-id')?.textContent === id", arg=run_id)
    assert page.evaluate("sessionStorage.getItem('rollout-buffer-token')") == TOKEN
    first = page.inner_text("#count-records")
    # No reload: the server-sent events move the stored-trajectory count while the run proceeds.
    page.wait_for_function("n => document.querySelector('#count-records').textContent !== n", arg=first)
    assert int(page.inner_text("#count-records")) > int(first)
    assert page.locator("#run-state").inner_text() in ("running", "finished")
    # The charts drew from the snapshots: in flight is a polyline.
    page.wait_for_selector("#chart-inflight polyline")


def test_the_inspector_styles_loss_0_and_loss_1_tokens_apart(page, buffer: Server, run_id: str) -> None:
    connect(page, buffer, TOKEN)
    page.wait_for_function("id => document.querySelector('#run-id')?.textContent === id", arg=run_id)
    page.wait_for_function("() => Number(document.querySelector('#count-records').textContent) > 0")
    page.select_option("#search select[name=status]", "completed")
    page.click("#search button")
    first = page.locator("#results tbody tr[data-uid]").first
    first.wait_for()
    uid = first.get_attribute("data-uid")
    page.locator(f"#results tr[data-uid='{uid}']").click()
    page.wait_for_function("uid => document.querySelector('#detail-title').textContent.startsWith(uid)", arg=uid)
    page.wait_for_selector("#tokens .tok.l1")
    styles = page.evaluate("""() => ['l0', 'l1'].map(c => {
        const s = getComputedStyle(document.querySelector('#tokens .tok.' + c));
        return [s.backgroundColor, s.color];
    })""")
    assert styles[0] != styles[1], styles
    stored = httpx.get(f"{buffer.url}/trajectories/{uid}", headers=AUTH, timeout=10).json()
    shown = page.evaluate("() => [...document.querySelectorAll('#tokens .tok')].map(t => Number(t.dataset.loss))")
    assert shown == stored["loss_mask"]  # every token, coloured by its own loss-mask entry
    hover = page.locator("#tokens .tok.l1").first.get_attribute("title")
    assert "log-prob -" in hover or "log-prob 0" in hover
    assert page.locator("#tokens .turn-mark").count() >= 1
    assert page.locator("#messages .msg.role-assistant").count() >= 1
    assert uid in page.inner_text("#detail-title")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard-inspector.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


def wait_stored(buffer: Server, run_id: str, n: int, timeout_s: float = 30) -> None:
    """Until the run has stored at least n trajectories."""
    deadline = time.monotonic() + timeout_s
    while sum(httpx.get(f"{buffer.url}/status", headers=AUTH, timeout=10).json()["records"].values()) < n:
        assert time.monotonic() < deadline, f"run {run_id} stored fewer than {n} trajectories in {timeout_s}s"
        time.sleep(0.2)


def test_the_api_pages_filters_and_names_bad_fields(buffer: Server, run_id: str) -> None:
    wait_stored(buffer, run_id, 24)
    url = f"{buffer.url}/ui/api/trajectories"
    seen: list[str] = []
    before = None
    for _ in range(3):
        params = {"run_id": run_id, "limit": 5, **({"before": before} if before else {})}
        page = httpx.get(url, params=params, headers=AUTH, timeout=10).json()
        rowids = [t["rowid"] for t in page["items"]]
        assert rowids == sorted(rowids, reverse=True) and len(rowids) == 5
        seen += [t["uid"] for t in page["items"]]
        before = page["next"]
    assert len(set(seen)) == 15  # pages never overlap
    ones = httpx.get(url, params={"run_id": run_id, "reward_min": 1}, headers=AUTH, timeout=10).json()["items"]
    assert ones and all(t["reward"] >= 1 for t in ones)
    one = seen[0]
    assert [t["uid"] for t in httpx.get(url, params={"uid": one}, headers=AUTH, timeout=10).json()["items"]] == [one]
    bad = httpx.get(url, params={"status": "bogus"}, headers=AUTH, timeout=10)
    assert bad.status_code == 422 and "status" in bad.json()["message"]
    across = httpx.get(url, params={"reward_min": 1}, headers=AUTH, timeout=10)  # no run: it would scan
    assert across.status_code == 422 and "run_id" in across.json()["message"]
    assert httpx.get(f"{url}/nope", headers=AUTH, timeout=10).status_code == 404


def test_the_token_view_and_group_of_a_session_record(buffer: Server, session_uids: list[str]) -> None:
    view = httpx.get(f"{buffer.url}/ui/api/trajectories/{session_uids[1]}/tokens", headers=AUTH, timeout=30).json()
    p = view["prompt_length"]
    assert view["text"][0] == "<|im_start|>" and "".join(view["text"][p:]).startswith("It is 5.")
    assert view["loss"] == [0] * p + [1] * (len(view["tokens"]) - p)
    assert view["logprob"][:p] == [None] * p and set(view["logprob"][p:]) == {-0.25}
    assert view["version"][p:] == ["7"] * (len(view["tokens"]) - p) and view["turn_starts"] == [p]
    assert view["mismatch"]["token_index"] == p + 1
    group = httpx.get(f"{buffer.url}/ui/api/trajectories/{session_uids[1]}", headers=AUTH, timeout=30).json()["group"]
    members = {m["uid"]: m for m in group["members"]}
    assert group["state"] == "ready" and set(members) == set(session_uids)
    assert members["ui-session-0"]["raw_reward"] == 1.0 and members["ui-session-0"]["normalized"]
    # GRPO over raw rewards [1, 0, 0, 0]: (1 − mean) / (population std + 1e-6)
    assert members["ui-session-0"]["reward"] == pytest.approx(0.75 / (statistics.pstdev([1, 0, 0, 0]) + 1e-6))
    assert (members["ui-session-1"]["parent_branch"], members["ui-session-1"]["fork_turn"]) == (0, 1)
    # Searching by the agent's role and by instance finds exactly these records.
    url, run = f"{buffer.url}/ui/api/trajectories", group["run_id"]
    by_role = httpx.get(url, params={"run_id": run, "role": "solver"}, headers=AUTH, timeout=10).json()["items"]
    assert [t["uid"] for t in by_role] == ["ui-session-1", "ui-session-0"] and by_role[0]["role"] == "solver"
    by_instance = httpx.get(url, params={"instance_id": "ui-session"}, headers=AUTH, timeout=10).json()["items"]
    assert {t["uid"] for t in by_instance} == set(session_uids)
    assert [t["reward"] for t in by_instance if t["uid"] == "ui-session-0"] == [1.0]  # raw, as scored


def test_the_inspector_shows_a_mismatch_and_session_branches(page, buffer: Server, run_id: str,
                                                             session_uids: list[str]) -> None:
    connect(page, buffer, TOKEN)
    page.wait_for_function("id => document.querySelector('#run-id')?.textContent === id", arg=run_id)
    page.fill("#search input[name=uid]", session_uids[1])
    page.click("#search button")
    # The search's own results, not the list shown before it (re-drawn when they arrive, under the click).
    page.wait_for_function("uid => { const rows = [...document.querySelectorAll('#results tr[data-uid]')];"
                           " return rows.length > 0 && rows.every((r) => r.dataset.uid.startsWith(uid)); }",
                           arg=session_uids[1])
    page.locator(f"#results tr[data-uid='{session_uids[1]}']").click()
    page.wait_for_selector("#tokens .tok.mismatch")
    assert "tokenization check" in page.inner_text("#token-note")
    assert "weights 7" in page.inner_text("#tokens")
    branches = page.inner_text("#group")
    assert "forked from 0 at turn 1" in branches and "normalized" in branches


def read_events(buffer: Server, count: int) -> list[tuple[str, dict]]:
    """The first `count` events of a new `/ui/api/events` stream, as (name, data)."""
    events: list[tuple[str, dict]] = []
    with httpx.stream("GET", f"{buffer.url}/ui/api/events", headers=AUTH, timeout=10) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, orjson.loads(line[len("data: "):])))
                if len(events) == count:
                    return events
    raise AssertionError(f"the stream ended after {events}")


def test_the_event_stream_sends_history_then_snapshots(buffer: Server, run_id: str) -> None:
    deadline = time.monotonic() + 10
    while True:  # the server samples every 2 s: a run started a moment ago may have no point yet
        (first, history), (second, snap), (third, later) = read_events(buffer, 3)
        points = [p for p in history["points"] if p["run_id"] == run_id]
        if points or time.monotonic() > deadline:
            break
    assert (first, second, third) == ("history", "snapshot", "snapshot")
    # The server sampled the run before this client connected.
    assert points and [p["done"] for p in points] == sorted(p["done"] for p in points)
    assert snap["run"]["run_id"] == run_id and later["t"] > snap["t"]
    assert {"engine", "latest_rowid", "groups", "records", "control"} <= set(snap)
    assert httpx.get(f"{buffer.url}/ui/api/events", timeout=10).status_code == 401


@pytest.fixture(scope="module", params=[0, 2], ids=["in-the-buffer", "on-two-session-workers"])
def agent_buffer(request, tmp_path_factory, sim_engine: Server, qwen_tokenizer_path: str) -> Iterator[Server]:
    """A buffer hosting agent sessions (a harness run: no input file), itself or on two session workers."""
    tmp = tmp_path_factory.mktemp("agent-buffer")
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp / "data"), "--auth-token", TOKEN]
    if request.param:
        args += ["--session-workers", str(request.param), "--session-worker-port", str(free_ports(request.param))]
    with running(args, "/healthz", port, tmp / "buffer.log") as srv:
        body = {"task_type": "agent", "remote_engine_url": sim_engine.url, "tokenizer_path": qwen_tokenizer_path,
                "max_tokens": 256}
        assert httpx.post(f"{srv.url}/start_rollout", json=body, headers=AUTH, timeout=60).status_code == 200
        yield srv


def test_an_open_capture_proxy_session_shows_its_branches(page, agent_buffer: Server) -> None:
    opened = httpx.post(f"{agent_buffer.url}/sessions", json={"instance_id": "live-1"}, headers=AUTH,
                        timeout=60).json()
    key = {"Authorization": f"Bearer {opened['api_key']}"}

    def turn(messages: list[dict]) -> str:
        resp = httpx.post(f"{opened['base_url']}/chat/completions", json={"model": "m", "messages": messages},
                          headers=key, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]["content"]

    question = {"role": "user", "content": "What is 3 + 4?"}
    answer = {"role": "assistant", "content": turn([question])}
    turn([question, answer, {"role": "user", "content": "And 5 + 5?"}])
    turn([question, answer, {"role": "user", "content": "And 6 + 6?"}])  # the same first turn, another follow-up
    other = httpx.post(f"{agent_buffer.url}/sessions", json={"instance_id": "live-2"}, headers=AUTH,
                       timeout=60).json()
    assert other.get("worker") != opened.get("worker") or "worker" not in opened, "with workers: one on each"
    connect(page, agent_buffer, TOKEN)
    page.wait_for_selector("#sessions .branch >> nth=1")
    lines = page.locator("#sessions .branch").all_inner_texts()
    assert lines[0].startswith("branch 0 · root") and "forked from 0 at turn 1" in lines[1], lines
    shown = page.inner_text("#sessions")
    assert opened["session_id"][:12] in shown and other["session_id"][:12] in shown, shown


def test_an_earlier_runs_undelivered_groups_show_beside_the_current_run(page, tmp_path: Path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--auth-token", TOKEN,
            "--group-size", "1"]
    with running(args, "/healthz", port, tmp_path / "buffer.log") as srv:
        leftover = {"uid": "left-0", "instance_id": "left", "reward": 1.0, "extra_info": {},
                    "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
        httpx.post(f"{srv.url}/buffer/write", json=leftover, headers=AUTH, timeout=30).raise_for_status()
        earlier = httpx.get(f"{srv.url}/status", headers=AUTH, timeout=10).json()["run"]["run_id"]
        data = write_jsonl(tmp_path / "math.jsonl", math_rows(1))
        current = start_run(srv.url, f"http://127.0.0.1:{free_port()}", data, None, headers=AUTH, max_retries=0)
        connect(page, srv, TOKEN)
        page.wait_for_function("id => document.querySelector('#run-id')?.textContent === id", arg=current)
        page.wait_for_selector("#count-earlier")
        assert page.inner_text("#count-earlier") == "1"
        assert earlier in page.locator("#count-earlier").locator("..").get_attribute("title")


# ---- the page as a new user sees it: charts, run ids, long messages, a clean load ------------------------
Problems = list[str]


@pytest.fixture
def open_dashboard(browser) -> Iterator[Callable[..., tuple[object, Problems]]]:
    """Opens `/ui` of a buffer with the token already in the tab's session storage (so the page connects at
    once, as after a reload); returns the page and what went wrong on it: console errors, uncaught exceptions,
    answers ≥ 400 and failed requests."""
    contexts = []

    def open_(srv: Server, width: int = 1400) -> tuple[object, Problems]:
        context = browser.new_context(viewport={"width": width, "height": 1100})
        contexts.append(context)
        context.add_init_script(f"sessionStorage.setItem('rollout-buffer-token', {json.dumps(TOKEN)})")
        pg = context.new_page()
        pg.set_default_timeout(15_000)
        problems: Problems = []
        pg.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
        pg.on("pageerror", lambda e: problems.append(f"exception: {e}"))
        pg.on("response", lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        pg.on("requestfailed", lambda r: problems.append(f"failed {r.url}: {r.failure}"))
        pg.goto(f"{srv.url}/ui")
        return pg, problems

    yield open_
    for context in contexts:
        context.close()


def connected(open_dashboard: Callable[..., tuple[Any, Problems]], srv: Server) -> tuple[Any, Problems]:
    """The dashboard of `srv`, once its page is live."""
    page, problems = open_dashboard(srv)
    page.wait_for_function("() => document.querySelector('#conn').textContent === 'live'")
    return page, problems


def chart(page, selector: str) -> dict:
    """What a chart shows: its title and values line, tick and unit texts, the text saying what would fill it,
    whether it has a line, the texts drawn over the plot area, and whether the values line sits above the chart."""
    return page.locator(selector).evaluate("""svg => {
        const fig = svg.closest('figure');
        const texts = (sel) => [...svg.querySelectorAll(sel)].map((t) => t.textContent);
        const plot = svg.querySelector('rect.plot');
        const p = plot && plot.getBoundingClientRect();
        const over = (r) => p && r.left < p.right && p.left < r.right && r.top < p.bottom && p.top < r.bottom;
        const now = fig.querySelector('.chart-now');
        return {
            title: fig.querySelector('.chart-title').textContent, now: now ? now.textContent : '',
            y: texts('text.tick.y'), x: texts('text.tick.x'), unit_y: texts('text.unit.y').join(' '),
            unit_x: texts('text.unit.x').join(' '), empty: texts('.empty').join(' '),
            line: svg.querySelector('polyline') !== null, bars: svg.querySelectorAll('rect.bar').length,
            over_plot: [...svg.querySelectorAll('text')].filter((t) => over(t.getBoundingClientRect()))
                .map((t) => t.textContent),
            now_above: !now || now.getBoundingClientRect().bottom <= svg.getBoundingClientRect().top,
        };
    }""")


def test_a_fresh_buffer_shows_empty_charts_and_the_page_loads_without_an_error(open_dashboard,
                                                                               tmp_path: Path) -> None:
    with own_buffer(tmp_path) as srv:
        page, problems = connected(open_dashboard, srv)
        # Three snapshots: two seconds and more on the page, by when the browser has asked for its icon.
        page.wait_for_function("() => state.snapshots >= 3")
        for key in UNITS:  # no run: every chart says what would fill it instead of showing an empty box
            shown = chart(page, f"#chart-{key}")
            assert shown["empty"] and not shown["line"] and not shown["y"], shown
            assert page.locator(f"#chart-{key} .empty").is_visible()
        assert "current_version" in chart(page, "#chart-lag")["empty"], "the lag says how a trainer reports it"
        assert page.inner_text("#batches").startswith("no batch delivered yet")
        assert problems == []
        # The server answered this page nothing ≥ 400, the browser's own /favicon.ico request included (Playwright
        # does not report it; without an icon in the page it is answered 401 here, 404 without a token).
        errors = {k: v for k, v in scrape(srv.url, AUTH).items() if k[0] == "rollout_buffer_http_errors_total"}
        assert sum(errors.values()) == 0, errors
        assert "favicon" not in srv.log()
        assert page.get_attribute("link[rel=icon]", "href").startswith("data:image/svg+xml,")


def test_each_chart_has_a_title_axes_with_units_and_its_labels_off_the_line(page, buffer: Server,
                                                                            run_id: str) -> None:
    connect(page, buffer, TOKEN)
    page.wait_for_function("id => document.querySelector('#run-id')?.textContent === id", arg=run_id)
    for key in ("reward", "throughput", "inflight", "latency"):
        page.wait_for_selector(f"#chart-{key} polyline")
    drawn = 0
    for key, unit in UNITS.items():
        shown = chart(page, f"#chart-{key}")
        assert shown["title"], shown
        if not shown["line"]:  # the lag needs a trainer's version: none in this run
            assert "no trainer version yet" in shown["empty"] and not shown["y"], shown
            continue
        drawn += 1
        assert shown["unit_y"] == unit, shown
        ticks = [float(v) for v in shown["y"]]
        assert len(ticks) >= 2 and ticks == sorted(ticks), shown
        assert shown["x"][-1] == "now" and len(shown["x"]) >= 2, shown
        assert all(re.fullmatch(r"−\d+ (s|min)", x) for x in shown["x"][:-1]), shown
        assert shown["over_plot"] == [] and shown["now_above"], shown  # no label on the plotted line
        now = re.fullmatch(rf"now \S+ {re.escape(unit)} · max (\S+)", shown["now"])
        assert now and float(now[1]) <= ticks[-1], shown  # the top tick covers the series
    assert drawn >= 4


def test_run_ids_stay_on_one_line_with_the_full_id_in_their_title(open_dashboard, buffer: Server,
                                                                  run_id: str) -> None:
    page, _ = open_dashboard(buffer, width=420)  # a narrow window: the panels stack, the runs table is tight
    page.wait_for_function("id => document.querySelector('#run-id')?.textContent === id", arg=run_id)
    page.wait_for_selector(f"#runs .run-id[title='{run_id}']")
    for selector in ("#run-id", f"#runs .run-id[title='{run_id}']"):
        # Found and read in one script: the dashboard redraws these elements as it polls, and a handle held across
        # a redraw reads a detached element (no computed style).
        white_space, overflow, title, text, height, font = page.evaluate("""selector => {
            const e = document.querySelector(selector), s = getComputedStyle(e);
            return [s.whiteSpace, s.textOverflow, e.title, e.textContent, e.getBoundingClientRect().height,
                    parseFloat(s.fontSize)];
        }""", selector)
        assert (white_space, overflow, title, text) == ("nowrap", "ellipsis", run_id, run_id), selector
        assert height < 2 * font, (selector, height, font)  # one line


def test_a_long_message_starts_collapsed_to_its_first_lines(page, buffer: Server, run_id: str) -> None:
    tools = [f"- tool_{i}: fetches item {i}. Parameters: " + json.dumps(
        {"type": "object", "properties": {f"arg_{i}": {"type": "string", "description": f"what tool {i} reads"}}})
        for i in range(24)]
    system = "You are an agent with 24 tools.\n" + "\n".join(tools)
    assert len(system) > 3000
    record = {"uid": "ui-long-0", "instance_id": "ui-long", "reward": 0.0, "extra_info": {},
              "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Find item 7."},
                           {"role": "assistant", "content": "Item 7 is a lamp."}]}
    httpx.post(f"{buffer.url}/buffer/write", json=record, headers=AUTH, timeout=30).raise_for_status()
    connect(page, buffer, TOKEN)
    page.wait_for_function("id => document.querySelector('#run-id')?.textContent === id", arg=run_id)
    page.fill("#search input[name=uid]", "ui-long-0")
    page.check("#search input[name=all_runs]")
    page.click("#search button")
    page.locator("#results tr[data-uid='ui-long-0']").click()
    details = page.locator("#messages .msg.role-system details")
    details.wait_for()
    assert details.evaluate("d => d.open") is False
    summary = details.locator("summary").inner_text()
    assert summary.startswith("You are an agent with 24 tools.\n- tool_0") and "tool_23" not in summary, summary
    assert f"{len(system)} characters" in summary
    assert not page.locator("#messages .msg.role-system .content").is_visible()
    assert page.locator("#messages .msg.role-system").bounding_box()["height"] < 200
    assert page.locator("#messages details").count() == 1  # the short messages are shown whole
    assert page.inner_text("#messages .msg.role-user .content") == "Find item 7."
    details.locator("summary").click()  # expands
    assert details.evaluate("d => d.open") is True
    full = page.locator("#messages .msg.role-system .content")
    assert full.is_visible() and full.text_content() == system


TOP_TICK = """([id, lo, hi]) => {
    const ticks = [...document.querySelectorAll('#' + id + ' text.tick.y')].map((t) => Number(t.textContent));
    return ticks.length > 0 && Math.max(...ticks) >= lo && Math.max(...ticks) <= hi;
}"""


def wait_history(srv: Server, found: Callable[[list[dict]], bool], timeout_s: float = 15) -> None:
    """Until the server's history (the stream's first event) holds what `found` looks for."""
    deadline = time.monotonic() + timeout_s
    while not found(read_events(srv, 1)[0][1]["points"]):
        assert time.monotonic() < deadline, f"the server's history did not show it in {timeout_s}s"
        time.sleep(0.5)


def test_a_chart_scales_to_the_current_run_not_an_earlier_runs_spike(open_dashboard, sim_engine: Server,
                                                                    qwen_tokenizer_path: str, tmp_path: Path) -> None:
    with own_buffer(tmp_path) as srv:
        wide = write_jsonl(tmp_path / "wide.jsonl", math_rows(400))
        first = start_run(srv.url, sim_engine.url, wide, qwen_tokenizer_path, headers=AUTH, num_process=24)
        live, _ = open_dashboard(srv)
        live.wait_for_function(TOP_TICK, arg=["chart-inflight", 20, 1e9])  # ~24 in flight
        wait_history(srv, lambda points: any(p["run_id"] == first and p["in_flight"] >= 20 for p in points))
        narrow = write_jsonl(tmp_path / "narrow.jsonl", math_rows(50))
        second = start_run(srv.url, sim_engine.url, narrow, qwen_tokenizer_path, headers=AUTH, num_process=2)
        # The open page: the new run's own scale (2 in flight at most), not the first run's 24.
        live.wait_for_function("id => document.querySelector('#run-id')?.textContent === id", arg=second)
        live.wait_for_function(TOP_TICK, arg=["chart-inflight", 1, 4])
        # A page opened now gets the server's history of both runs: it draws the current one only.
        wait_history(srv, lambda points: any(p["run_id"] == second for p in points))
        fresh, problems = open_dashboard(srv)
        fresh.wait_for_function("id => document.querySelector('#run-id')?.textContent === id", arg=second)
        fresh.wait_for_function(TOP_TICK, arg=["chart-inflight", 1, 4])
        assert problems == []
        # A delivered batch: its reward histogram has axes with units too.
        taken = httpx.post(f"{srv.url}/get_rollout_data", json={"max_groups": 2, "wait_s": 30}, headers=AUTH,
                           timeout=60).json()
        assert taken["success"], taken
        histogram = live.locator("#batches figure svg").first
        histogram.locator("rect.bar").first.wait_for()
        shown = chart(live, "#batches figure svg >> nth=0")
        assert shown["title"].startswith("batch of ") and shown["bars"] >= 1, shown
        assert shown["unit_x"] == "reward (raw)" and shown["unit_y"] == "trajectories", shown
        assert [float(x) for x in shown["x"]] == sorted(float(x) for x in shown["x"]) and len(shown["x"]) >= 2
        assert len(shown["y"]) >= 2 and shown["over_plot"] == [], shown


def test_a_run_its_full_store_stopped_is_shown_with_why_and_the_refused_write(open_dashboard, sim_engine: Server,
                                                                               qwen_tokenizer_path: str,
                                                                               tmp_path: Path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--auth-token", TOKEN,
            "--max-db-mb", "0.3"]
    with running(args, "/healthz", port, tmp_path / "buffer.log") as srv:
        page, problems = connected(open_dashboard, srv)
        assert page.locator("#run-alert").is_hidden()
        start_run(srv.url, sim_engine.url, write_jsonl(tmp_path / "math.jsonl", math_rows(64)), qwen_tokenizer_path,
                  headers=AUTH)
        page.wait_for_function("() => document.querySelector('#run-state')?.textContent === 'failed'",
                               timeout=60_000)
        alert = page.locator("#run-alert")
        alert.wait_for()
        lines = alert.inner_text().splitlines()
        assert lines[0].startswith("run failed: StoreError") and "the run resumes where it stopped" in lines[0]
        assert re.fullmatch(r"the store refused a write \d+ s ago: database or disk is full", lines[1]), lines
        assert problems == []


def test_an_engine_outage_is_shown_while_generation_waits(open_dashboard, qwen_tokenizer_path: str,
                                                         tmp_path: Path) -> None:
    with own_buffer(tmp_path) as srv:
        page, problems = connected(open_dashboard, srv)
        down = f"http://127.0.0.1:{free_port()}"
        start_run(srv.url, down, write_jsonl(tmp_path / "math.jsonl", math_rows(4)), qwen_tokenizer_path,
                  headers=AUTH, max_retries=0, backoff_s=0.05)
        alert = page.locator("#run-alert")
        page.wait_for_function("() => /engine outage for/.test(document.querySelector('#run-alert').textContent)",
                               timeout=60_000)
        text = alert.inner_text()
        assert down in text and "1800 s before the run fails" in text and "generation waits" in text, text
        assert httpx.get(f"{srv.url}/status", headers=AUTH).json()["run"]["state"] == "running"
        assert problems == []


def test_a_short_run_fills_every_chart_and_the_numbers_are_those_of_status(open_dashboard, sim_engine: Server,
                                                                           qwen_tokenizer_path: str,
                                                                           tmp_path: Path) -> None:
    """The run as a trainer's dashboard shows one: reward, throughput, in flight, version lag and engine latency
    over time, each with data after a short run; the counts on the page are those of `/status`; a clicked
    trajectory opens where the eye is; no count or uid wraps."""
    with own_buffer(tmp_path) as srv:
        page, problems = connected(open_dashboard, srv)
        run_id = start_run(srv.url, sim_engine.url, write_jsonl(tmp_path / "math.jsonl", math_rows(24)),
                           qwen_tokenizer_path, headers=AUTH, num_process=4)
        # A trainer fetching with its version, as the adapter does: the lag chart has data.
        for version in (1, 2):
            httpx.post(f"{srv.url}/get_rollout_data", headers=AUTH, timeout=60,
                       json={"max_groups": 1, "wait_s": 30, "current_version": version})
        for key in UNITS:  # attached: a flat line has no height, which Playwright calls hidden
            page.wait_for_selector(f"#chart-{key} polyline", state="attached", timeout=60_000)
        status = wait_run_over(srv)
        page.wait_for_function("t => document.querySelector('#count-done').textContent === t", timeout=30_000,
                               arg=f"{status['run']['progress']['done']} / {status['run']['progress']['total']}")
        status = httpx.get(f"{srv.url}/status", headers=AUTH, timeout=10).json()
        page.wait_for_function("n => document.querySelector('#count-ready').textContent === n",
                               arg=str(status["groups"].get("ready", 0)), timeout=30_000)
        progress = status["run"]["progress"]
        assert page.inner_text("#count-failed") == str(progress["failed"])
        # The page rounds as JavaScript's toFixed does (0.5625 → 0.563, where Python's format gives 0.562).
        shown = page.inner_text("#count-reward")
        assert len(shown.split(".")[1]) == 3
        assert float(shown) == pytest.approx(progress["reward_sum"] / progress["rewarded"], abs=0.0005 + 1e-9)
        assert page.inner_text(f"#runs tr[data-run='{run_id}'] td.progress") == page.inner_text("#count-done")
        # Labels and counts on one line each; a uid cut with an ellipsis, never wrapped.
        heights = page.evaluate("""() => [...document.querySelectorAll('#run-counts dt, #run-counts dd')]
            .map((e) => e.getBoundingClientRect().height / parseFloat(getComputedStyle(e).lineHeight || 16))""")
        assert heights and max(heights) < 1.9, heights
        page.click("#search button")
        row = page.locator("#results tbody tr[data-uid]").nth(40)
        row.wait_for()
        white_space = row.locator("td.uid").evaluate("e => getComputedStyle(e).whiteSpace")
        assert white_space == "nowrap"
        row.click()
        page.wait_for_selector("#detail:not([hidden])")
        page.wait_for_function("""() => { const r = document.querySelector('#detail').getBoundingClientRect();
                                          return r.top >= -1 && r.top < window.innerHeight / 2; }""")
        assert problems == []


def wait_run_over(srv: Server, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while (status := httpx.get(f"{srv.url}/status", headers=AUTH, timeout=10).json())["run"]["state"] == "running":
        assert time.monotonic() < deadline, status["run"]
        time.sleep(0.2)
    return status


def test_a_records_images_show_in_the_inspector_fetched_with_the_token(open_dashboard, tmp_path: Path) -> None:
    """A native vision run's record opened in the inspector: each image part is drawn where the message has it,
    from `/images/{sha256}` read with the token (the image URL alone, without it, is refused)."""
    checkpoint = vision_checkpoint(tmp_path / "checkpoint")
    rows = [{"instance_id": "red", "prompt": "What colour is it?", "label": "red",
             "images": ["data:image/png;base64," + base64.b64encode(png((220, 30, 30), (64, 48))).decode()]}]
    (tmp_path / "sim").mkdir()
    with start_sim_engine(tmp_path / "sim", str(checkpoint)) as engine, own_buffer(tmp_path) as srv:
        run = start_run(srv.url, engine.url, write_jsonl(tmp_path / "vision.jsonl", rows), str(checkpoint),
                        headers=AUTH, task_type="vision", num_repeat_per_sample=1, max_tokens=32)
        wait_stored(srv, run, 1)
        listed = httpx.get(f"{srv.url}/ui/api/trajectories", params={"run_id": run}, headers=AUTH, timeout=10)
        uid = listed.json()["items"][0]["uid"]
        sha = httpx.get(f"{srv.url}/trajectories/{uid}", headers=AUTH, timeout=10).json()["images"][0]["sha256"]
        assert httpx.get(f"{srv.url}/images/{sha}", timeout=10).status_code == 401
        page, problems = connected(open_dashboard, srv)
        page.fill("#search input[name=uid]", uid)
        page.click("#search button")
        page.locator(f"#results tr[data-uid='{uid}']").click()
        image = page.locator("#messages .msg.role-user img.msg-image")
        image.wait_for()
        page.wait_for_function("() => document.querySelector('#messages img.msg-image')?.naturalWidth > 0")
        assert image.evaluate("i => [i.naturalWidth, i.naturalHeight]") == [64, 48]
        assert sha in (image.get_attribute("title") or "")
        assert "What colour is it?" in page.inner_text("#messages .msg.role-user")
    assert problems == [], problems
