"""`rollout-buffer status`: a running buffer's run, a progress bar and the counts, once or refreshed."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import httpx
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from rollout_buffer.config import AUTH_TOKEN_ENV, DEFAULT_PORT

URL_ENV = "ROLLOUT_BUFFER_URL"
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
# Group states in the order a group passes through them.
GROUP_STATES = ("open", "ready", "leased", "delivered", "filtered")

EXAMPLES = f"""\
examples:
  rollout-buffer status                                   # the buffer at {DEFAULT_URL}
  rollout-buffer status --url http://gpu-node-3:8889 --token "$TOKEN"
  rollout-buffer status --watch                           # refresh every 2 s until Ctrl-C
  rollout-buffer status --watch --until-done && echo ok   # wait for the run; exit 1 if it did not finish

The URL and token default to ${URL_ENV} and ${AUTH_TOKEN_ENV}.
"""


class StatusError(RuntimeError):
    """The buffer could not be asked; the message says why."""


def fetch_status(client: httpx.Client, url: str) -> dict[str, Any]:
    """GET /status, with errors a user can act on."""
    try:
        resp = client.get(f"{url}/status")
    except httpx.HTTPError as e:
        raise StatusError(f"cannot reach {url}: {e}") from None
    if resp.status_code == 401:
        raise StatusError(f"{url} wants a bearer token: pass --token or set {AUTH_TOKEN_ENV}")
    if resp.status_code != 200:
        raise StatusError(f"{url}/status answered {resp.status_code}: {resp.text[:300]}")
    status: dict[str, Any] = resp.json()  # the buffer's /status is a JSON object
    return status


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _counts(counts: dict[str, int], order: tuple[str, ...] = ()) -> str:
    keys = [k for k in order if counts.get(k)] + sorted(k for k in counts if k not in order and counts[k])
    return "  ".join(f"{k} {counts[k]}" for k in keys) or "-"


def render(status: dict[str, Any], url: str) -> RenderableType:
    """The run, a progress bar over its trajectories and the counts, as rich renderables."""
    run = status.get("run")
    queue = status.get("all_groups") or {}
    if run is None:
        return Text(f"{url}: no run yet (the store is empty); ready groups {queue.get('ready', 0)}")
    progress = run.get("progress") or {}
    total = int(progress.get("total") or 0)
    done, failed, skipped = (int(progress.get(k) or 0) for k in ("done", "failed", "skipped"))
    finished = done + failed + skipped
    head = Text.assemble(
        (run["run_id"], "bold"), "  ", (run["state"], _state_style(run["state"])),
        f"  {run.get('task_type') or '-'}  {run.get('input_file') or ''}",
    )
    bar = Table.grid(padding=(0, 1))
    bar.add_row(
        ProgressBar(total=max(total, 1), completed=min(finished, total) if total else 0, width=40),
        Text(f"{finished}/{total or '?'} trajectories"),
        Text(f"{100 * finished / total:.0f}%" if total else ""),
    )
    rows = [("progress", _progress_line(progress, done, failed, skipped)),
            ("groups", _counts(status.get("groups") or {}, GROUP_STATES)),
            ("records", _counts(status.get("records") or {}, ("completed", "truncated", "aborted", "failed")))]
    if status.get("filtered"):
        rows.append(("filtered", _counts(status["filtered"])))
    for role, counts in (status.get("roles") or {}).items():
        version = counts.get("trainer_version")
        rows.append((f"role {role}", f"{_counts(counts.get('groups') or {}, GROUP_STATES)}  records "
                     f"{counts.get('records', 0)}" + (f"  trainer v{version}" if version is not None else "")))
    if progress.get("failures"):
        rows.append(("failures", _counts(progress["failures"])))
    rows.append(("queue", f"ready {queue.get('ready', 0)}  leased {queue.get('leased', 0)}  (all runs)"))
    if control_line := _control_line(status.get("control") or {}):
        rows.append(("versions", control_line))
    rows += _eval_rows(status.get("evals") or {})
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="dim")
    grid.add_column()
    for name, line in rows:
        grid.add_row(name, Text(line))
    if run.get("error"):
        grid.add_row("error", Text(str(run["error"]), style="red"))
    if refused := (status.get("store") or {}).get("last_refusal"):
        grid.add_row("store", Text(f"refused a write {_duration(time.time() - refused['at'])} ago: "
                                   f"{refused['error']}", style="red"))
    return Group(head, bar, grid)


def _control_line(control: dict[str, Any]) -> str:
    """The trainer's version, the engines' and the admission state, when the run has any of them."""
    admission = control.get("admission") or {}
    parts = []
    if control.get("trainer_version") is not None:
        parts.append(f"trainer {control['trainer_version']}")
    if control.get("engine_version") is not None:
        parts.append(f"engines {control['engine_version']}")
    if admission.get("state"):
        parts.append(f"admission {admission['state']}")
    if admission.get("groups_ahead") is not None and admission.get("max_staleness") is not None:
        parts.append(f"{admission['groups_ahead']} groups ahead (η {admission['max_staleness']}, "
                     f"capacity {admission.get('capacity')})")
    return "  ".join(parts)


def _eval_rows(evals: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per eval dataset (its newest version): state, samples, mean reward, pass@1 and pass@n,
    truncation rate, mean response length; and the eval trajectories in flight when there are any."""
    rows = []
    for e in evals.get("latest") or []:
        parts = [f"v{e['version']} {e['state']}", f"{e['samples']}/{e['expected_samples']} samples"]
        if e.get("mean_reward") is not None:
            parts.append(f"reward {e['mean_reward']:.3f}")
        passes = list((e.get("pass_at_k") or {}).items())
        parts += [f"{k} {v:.3f}" for k, v in (passes[:1] + passes[1:][-1:])]
        if e.get("truncation_rate") is not None:
            parts.append(f"truncated {e['truncation_rate']:.1%}")
        if e.get("mean_response_length") is not None:
            parts.append(f"length {e['mean_response_length']:.0f}")
        rows.append((f"eval {e['dataset']}", "  ".join(parts)))
    if evals.get("in_flight"):
        rows.append(("evals", f"in flight {evals['in_flight']} of {evals.get('eval_num_process')}"))
    return rows


def _progress_line(progress: dict[str, Any], done: int, failed: int, skipped: int) -> str:
    line = f"done {done}  failed {failed}  skipped {skipped}  in flight {progress.get('in_flight', 0)}"
    if progress.get("rate"):
        line += f"  {progress['rate']:.1f} traj/s"
    if progress.get("elapsed_s"):
        line += f"  elapsed {_duration(progress['elapsed_s'])}"
    return line


def _state_style(state: str) -> str:
    return {"running": "cyan", "finished": "green", "failed": "red"}.get(state, "yellow")


def _run_ended(status: dict[str, Any]) -> bool:
    run = status.get("run")
    return run is not None and run["state"] != "running"


def watch(client: httpx.Client, url: str, console: Console, interval_s: float, until_done: bool) -> dict[str, Any]:
    """Refresh until Ctrl-C (or until the run ends with `until_done`); returns the last status.

    On a terminal the view is redrawn in place; piped output gets one block per refresh.
    """
    status = fetch_status(client, url)
    live = Live(render(status, url), console=console, auto_refresh=False) if console.is_terminal else None
    if live is None:
        console.print(render(status, url))
    else:
        live.start()
    try:
        while not (until_done and _run_ended(status)):
            time.sleep(interval_s)
            status = fetch_status(client, url)
            if live is None:
                console.print()
                console.print(render(status, url))
            else:
                live.update(render(status, url), refresh=True)
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
    return status


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `rollout-buffer status`."""
    p = argparse.ArgumentParser(
        prog="rollout-buffer status",
        description="Print a running buffer's run, a progress bar and the counts of groups and trajectories.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", default=os.environ.get(URL_ENV, DEFAULT_URL), help="the buffer (default: %(default)s)")
    p.add_argument("--token", default=os.environ.get(AUTH_TOKEN_ENV), help="bearer token, when the server has one")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default: %(default)s)")
    p.add_argument("--until-done", action="store_true",
                   help="with --watch: stop when the run ends; exit 1 unless it finished")
    return p


def main(argv: list[str]) -> None:
    """Entry point of `rollout-buffer status`."""
    args = build_parser().parse_args(argv)
    if args.interval <= 0:
        build_parser().error("--interval must be positive")
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    console = Console(highlight=False)
    with httpx.Client(headers=headers, timeout=10) as client:
        try:
            if args.watch:
                status = watch(client, url, console, args.interval, args.until_done)
            else:
                status = fetch_status(client, url)
                console.print(render(status, url))
        except StatusError as e:
            Console(stderr=True, highlight=False, markup=False).print(f"error: {e}", style="red")
            raise SystemExit(2) from None
    if args.until_done and (status.get("run") or {}).get("state") != "finished":
        raise SystemExit(1)
