"""The benchmarks run end to end (tiny sizes, short windows): each prints its tables and its SUMMARY line.

They are run by hand for their numbers (README "Performance"); this only keeps them working. Nothing here
asserts a speed: the rows must exist and count real deliveries, whatever the machine does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from servers import free_port, running

REPO = Path(__file__).resolve().parents[1]
NUMBER = r"(\d+(?:\.\d+)?)"


def run_bench(module: str, *args: str, timeout_s: float = 240) -> str:
    """Run `python -m bench.<module> args...` from the repository; its output, after checking it succeeded. A bench
    keeps its working folder for whoever ran it; the test's goes with the temporary folder it is given."""
    with tempfile.TemporaryDirectory(prefix="bench-tmp-") as scratch:
        done = subprocess.run([sys.executable, "-m", f"bench.{module}", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=timeout_s, env={**os.environ, "COLUMNS": "200", "TMPDIR": scratch})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def summary_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("SUMMARY ")]
    assert len(lines) == 1, output[-3000:]
    return lines[0]


def test_throughput_measures_buffer_bare_client_and_baseline(tmp_path: Path) -> None:
    out = run_bench("throughput", "--quick", "--latency-ms", "20", "--in-flight", "16", "--modes", "token,chat",
                    "--window-s", "1", "--workdir", str(tmp_path))
    line = summary_line(out)
    token = re.search(rf"16@20ms/token {NUMBER}% {NUMBER}×base {NUMBER}MB", line)
    chat = re.search(rf"16@20ms/chat {NUMBER}% {NUMBER}×base {NUMBER}MB", line)
    assert token and chat, line
    assert float(token.group(1)) > 0 and float(chat.group(1)) > 0 and float(chat.group(2)) > 0
    for system in ("bare", "buffer", "baseline"):
        assert re.search(rf"│ {system} +│ +\d+ ", out), f"no {system} row:\n{out[-3000:]}"
    assert list(tmp_path.glob("buffer-*.log"))


def test_throughput_against_an_engine_started_elsewhere(tmp_path: Path, qwen_tokenizer_path: str) -> None:
    """`--engine-url` (what real_sglang/gpu_check.sh runs on a GPU): no simulated latency, the bare client's rate
    is the ceiling; here the engine started elsewhere is a simulator."""
    port = free_port()
    with running(["sim-engine", "--port", str(port), "--tokenizer", qwen_tokenizer_path, "--latency-ms", "20"],
                 "/health", port, tmp_path / "engine.log") as engine:
        out = run_bench("throughput", "--engine-url", engine.url, "--engine-pid", str(engine.proc.pid), "--in-flight",
                        "16", "--modes", "token", "--no-baseline", "--window-s", "1", "--workdir", str(tmp_path))
    found = re.search(rf"16@0ms/token {NUMBER}% {NUMBER}MB", summary_line(out))
    assert found and float(found.group(1)) > 0, out[-3000:]
    for system in ("bare", "buffer"):
        assert re.search(rf"│ {system} +│ +\d+ ", out), f"no {system} row:\n{out[-3000:]}"


def test_conversion_compares_exact_tokens_with_retokenizing() -> None:
    line = summary_line(run_bench("conversion", "--samples", "16", "--tokens", "512"))
    assert re.search(rf"exact tokens {NUMBER}× faster than re-tokenizing", line), line


def test_store_write_measures_what_completing_a_group_of_long_records_costs() -> None:
    line = summary_line(run_bench("store_write", "--long-tokens", "2000", "--records", "16"))
    found = re.search(rf"{NUMBER} ms CPU per 2000-token record, of which completing its group -?{NUMBER} ms", line)
    assert found and float(found.group(1)) > 0, line


def test_store_write_measures_group_commit_and_http_writers() -> None:
    line = summary_line(run_bench("store_write", "--writers", "20", "--records", "400", "--window-s", "2"))
    rate = re.search(rf"/buffer/write with 20 writers: {NUMBER} records/s", line)
    assert rate and float(rate.group(1)) > 0, line


def test_trainer_wait_measures_both_fetch_loops() -> None:
    # Generation (16 in flight × 200 ms: 10 groups/s) slower than training (2 groups per 0.1 s), as in the bench.
    out = run_bench("trainer_wait", "--duration-s", "4", "--latency-ms", "200", "--in-flight", "16",
                    "--batch-groups", "2", "--train-s", "0.1")
    line = summary_line(out)
    assert re.search(rf"long-poll median {NUMBER} ms, p99 {NUMBER} ms; 5 s polling \(original\) median {NUMBER} ms",
                     line), line


def test_staleness_measures_throughput_and_lag_per_bound() -> None:
    # Generation (8 in flight × 50 ms) and a 0.2 s trainer step, two steps per bound: only the rows count here.
    out = run_bench("staleness", "--steps", "2", "--train-s", "0.2", "--latency-ms", "50", "--in-flight", "8",
                    "--batch-groups", "2", "--group-size", "2", "--etas", "1,inf")
    line = summary_line(out)
    bounded = re.search(rf"η=1 {NUMBER}/s {NUMBER}% lag mean {NUMBER} max (\d+)", line)
    unbounded = re.search(rf"η=∞ {NUMBER}/s 100% lag mean {NUMBER} max (\d+)", line)
    assert bounded and unbounded, line
    assert float(bounded.group(1)) > 0 and int(bounded.group(4)) <= 1
    assert "Lag distribution" in out


def test_proxy_measures_agent_turns_against_the_engine_directly(tmp_path: Path) -> None:
    out = run_bench("proxy", "--sessions", "8", "--turns", "3", "--latency-ms", "20", "--warmup-s", "1",
                    "--window-s", "2", "--workdir", str(tmp_path), "--workers", "0,1", "--front")
    found = re.search(rf"SUMMARY proxy 8@20ms: {NUMBER} turns/s, {NUMBER}% of direct, {NUMBER} ms buffer CPU per "
                      rf"turn \({NUMBER} storing\)\n", out)
    assert found and float(found.group(1)) > 0 and float(found.group(3)) > 0, out[-3000:]
    assert 0 < float(found.group(4)) < float(found.group(3)), "the store thread's share of the buffer's CPU"
    # With a session worker, the turns' CPU is the worker's; the buffer only places, finishes and stores.
    found = re.search(rf"SUMMARY proxy, 1 workers 8@20ms: {NUMBER} turns/s, {NUMBER}% of direct, {NUMBER} ms buffer "
                      rf"CPU per turn \({NUMBER} storing\), {NUMBER} ms in workers", out)
    assert found and float(found.group(1)) > 0 and float(found.group(5)) > 0, out[-3000:]
    # The same worker reached through a forwarding front: the turns pass through it, and it counts its CPU.
    found = re.search(rf"SUMMARY proxy, 1 workers, through a front 8@20ms: {NUMBER} turns/s, .* {NUMBER} ms in "
                      rf"workers, {NUMBER} ms in the front", out)
    assert found and float(found.group(1)) > 0 and float(found.group(3)) > 0, out[-3000:]
    assert re.search(r"│ direct +│ +\d", out) and re.search(r"│ proxy +│ +\d", out), out[-3000:]


def test_proxy_long_session_measures_cpu_per_turn_against_context(tmp_path: Path) -> None:
    out = run_bench("proxy", "--long-session", "--protocol", "responses", "--sessions", "1", "--new-tokens", "500",
                    "--context-tokens", "4000", "--workdir", str(tmp_path))
    line = summary_line(out)
    found = re.search(rf"late turns {NUMBER} ms buffer CPU at ~{NUMBER} tokens of context = {NUMBER}x tokenizing",
                      line)
    assert found and float(found.group(1)) > 0 and float(found.group(2)) >= 4000, line
    # The same bodies through a proxy that only moves their bytes (bench/bytes_floor.py): its CPU is read too.
    floor = re.search(rf"bytes floor: a bare proxy moving the same bytes {NUMBER} ms early, {NUMBER} ms late", line)
    assert floor and float(floor.group(1)) > 0 and float(floor.group(2)) > 0, line


def test_proxy_opens_measures_the_buffers_cpu_per_session_opened(tmp_path: Path) -> None:
    out = run_bench("proxy", "--opens", "--rates", "200", "--count", "64", "--clients", "4", "--idle-s", "1",
                    "--workdir", str(tmp_path))
    line = summary_line(out)
    found = re.search(rf"opens, 1 workers: idle {NUMBER} ms/s, {NUMBER}/s {NUMBER} ms/open", line)
    assert found and float(found.group(2)) > 0 and float(found.group(3)) > 0, line


def test_proxy_pair_measures_two_buffers_over_the_same_windows(tmp_path: Path) -> None:
    out = run_bench("proxy_pair", "--sessions", "4", "--latency-ms", "20", "--warmup-s", "4", "--window-s", "1",
                    "--rounds", "2", "--candidate-option", "session_journal=false", "--candidate-flag=--no-shortcuts",
                    "--workdir", str(tmp_path))
    line = summary_line(out)
    found = re.search(rf"proxy pair 4x2@20ms: candidate/baseline CPU per turn {NUMBER} \(rounds: {NUMBER}, {NUMBER}\)",
                      line)
    assert found and float(found.group(1)) > 0, line
    rounds = re.findall(rf"round \d: baseline {NUMBER} turns/s {NUMBER} ms/turn \| candidate {NUMBER} turns/s", out)
    assert len(rounds) == 2 and all(float(r[0]) > 0 and float(r[2]) > 0 for r in rounds), out[-3000:]


def test_idle_pair_meters_two_idle_buffers_over_the_same_windows(tmp_path: Path) -> None:
    out = run_bench("idle_pair", "--rounds", "2", "--window-s", "0.5", "--settle-s", "0",
                    "--candidate-flag=--no-shortcuts=quiet_server", "--workdir", str(tmp_path))
    found = re.search(rf"idle pair: baseline {NUMBER} ms/s, candidate {NUMBER} ms/s over 2 x 0.5 s", summary_line(out))
    assert found, out[-3000:]
    assert len(re.findall(rf"round \d: baseline {NUMBER} ms/s \| candidate {NUMBER} ms/s", out)) == 2, out[-3000:]


def test_ui_queries_times_every_dashboard_query() -> None:
    out = run_bench("ui_queries", "--records", "1024", "--repeat", "2")
    line = summary_line(out)
    assert re.search(rf"records=1024 worst_p95_ms={NUMBER}", line), line
    for query in ("newest page of the run", "status = failed", "token view", "12 newest batches"):
        assert re.search(rf"│ {re.escape(query)} +│ +\d+ ", out), f"no {query} row:\n{out[-3000:]}"


def test_engine_restart_measures_the_losses_before_and_after_outages() -> None:
    out = run_bench("engine_restart", "--items", "8", "--down-s", "2", "--latency-ms", "100", "--in-flight", "8")
    line = summary_line(out)
    after = re.search(r"wait \(after\): (\d+) failed, (\d+) dropped, (\d+)/8 delivered", line)
    assert re.search(r"fail \(before\): \d+ failed, \d+ dropped, \d+/8 delivered", line) and after, line
    assert after.groups() == ("0", "0", "8"), line


def test_replay_cost_measures_routing_replays_bytes_and_cpu(tmp_path: Path) -> None:
    out = run_bench("replay_cost", "--tokens", "512", "--layers", "4", "--top-k", "2", "--items", "2", "--rounds", "1",
                    "--workdir", str(tmp_path))
    line = summary_line(out)
    found = re.search(rf"side data {NUMBER}x the raw int32 size.*CPU per sample, routing \(4x2\) and top-p replay "
                      rf"on / off: {NUMBER}", line)
    assert found and float(found.group(1)) < 1.1 and float(found.group(2)) > 0, line


def test_image_cost_measures_a_screenshot_agents_cpu_and_stores_each_image_once(tmp_path: Path) -> None:
    out = run_bench("image_cost", "--sessions", "1", "--turns", "3", "--rounds", "1", "--width", "320", "--height",
                    "200", "--workdir", str(tmp_path))
    line = summary_line(out)
    found = re.search(rf"screenshots / text: {NUMBER} .*images sent 6, stored 3 of 3 distinct, {NUMBER}x", line)
    assert found and float(found.group(1)) > 0 and float(found.group(2)) == 1.0, line
