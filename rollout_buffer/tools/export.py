"""`rollout-buffer export`: stored trajectories (or eval results) as JSONL, read straight from the SQLite store.

The store is opened read-only; SQLite's WAL mode lets this reader see one consistent snapshot while a
running server keeps writing, and nothing here can change or lock the server's data. Records are written
exactly as stored (the bytes the server would deliver: normalized `reward`, original `raw_reward`).
"""

from __future__ import annotations

import argparse
import os
import re
import sqlite3
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import orjson
from rich.console import Console

from rollout_buffer.delivery import schema
from rollout_buffer.delivery.evals import read_records, read_summaries
from rollout_buffer.delivery.record_layout import REWARDED_SQL, REWARDS_JOIN_SQL, with_rewards
from rollout_buffer.media.image_store import ImageStore
from rollout_buffer.schemas import TrajectoryStatus

DB_NAME = "buffer.sqlite"
_IMAGE_SHA = re.compile(rb'"sha256":"([0-9a-f]{64})"')
STATUSES: tuple[TrajectoryStatus, ...] = ("completed", "truncated", "aborted", "failed")

EXAMPLES = """\
examples:
  # every trajectory the trainer received, all runs
  rollout-buffer export --data-dir /data/rollout_buffer --out delivered.jsonl
  # the newest run, everything it stored (failed, filtered and unfinished groups too)
  rollout-buffer export --data-dir /data/rollout_buffer --out run.jsonl --run latest --all
  # completed trajectories of one run, for SFT
  rollout-buffer export --data-dir ./rollout_data --out sft.jsonl --run run-20250101-120000-ab12cd --status completed
  # what the planner's trainer received from its role stream (plan/act with two models)
  rollout-buffer export --data-dir ./rollout_data --out planner.jsonl --agent-id planner
  # to stdout, while the server runs
  rollout-buffer export --data-dir ./rollout_data --out - | jq .reward
  # eval curves: one summary per dataset and version (mean reward, pass@k, truncation rate, response length)
  rollout-buffer export --data-dir ./rollout_data --out evals.jsonl --eval
  # the eval trajectories of one dataset
  rollout-buffer export --data-dir ./rollout_data --out aime.jsonl --eval-records --dataset aime
"""


class ExportError(RuntimeError):
    """The store cannot be read or the selection names nothing; the message says which."""


@dataclass(frozen=True)
class ExportSummary:
    """What one export wrote."""

    records: int
    run_ids: tuple[str, ...]
    by_role: dict[str, int] = field(default_factory=dict)  # records per `extra_info.agent_id`, when they have one
    pruned: int = 0  # selected, but cut down to their facts (`delivery.retention`): not written
    images: frozenset[str] = frozenset()  # the images the written records name (their SHA-256)


def open_readonly(data_dir: Path) -> sqlite3.Connection:
    """The data dir's store, opened read-only (URI `mode=ro`): writes are refused by SQLite itself."""
    db = data_dir / DB_NAME
    if not db.is_file():
        raise ExportError(f"--data-dir: no store at {db} (is this the server's --data-dir?)")
    try:
        conn = sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True, isolation_level=None, timeout=10)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.Error as e:
        raise ExportError(f"cannot read {db}: {e}") from None
    if version != schema.VERSION:
        conn.close()
        newer = version > schema.VERSION
        raise ExportError(f"{db} is at store version {version}, this release reads version {schema.VERSION}: "
                          + ("upgrade rollout-buffer" if newer else
                             "open it once with `rollout-buffer serve --data-dir` (which upgrades it) and export "
                             "again"))
    return conn


def select_runs(conn: sqlite3.Connection, run: str | None) -> list[str]:
    """Run ids to export: all (None), the newest (`latest`), or the one named."""
    rows = conn.execute("SELECT run_id FROM runs ORDER BY created_at, rowid").fetchall()
    ids = [r[0] for r in rows]
    if run is None:
        return ids
    if run == "latest":
        if not ids:
            raise ExportError("--run latest: the store has no runs yet")
        return ids[-1:]
    if run not in ids:
        known = ", ".join(ids[-5:]) or "none"
        raise ExportError(f"--run: no run {run!r} in the store (latest runs: {known})")
    return [run]


def iter_records(conn: sqlite3.Connection, run_id: str | None, delivered_only: bool,
                 statuses: tuple[str, ...] = (), agent_id: str | None = None
                 ) -> Iterator[tuple[bytes | None, str | None]]:
    """The stored JSON and role of each selected trajectory (one run, or all; one role's), in delivery order,
    or in write order when everything is exported; None for a record pruned to its facts. Delivered, for a role,
    means consumed on its role stream."""
    where: list[str] = []
    args: list[str] = []
    if run_id is not None:
        where.append("t.run_id=?")
        args.append(run_id)
    if statuses:
        where.append(f"t.status IN ({','.join('?' * len(statuses))})")
        args += statuses
    if agent_id is not None:
        where.append("t.agent_id=?")
        args.append(agent_id)
    if delivered_only:
        # Delivered on the stream asked for: a role's (its records of each group) or the default one (all).
        sql = (
            f"SELECT {REWARDED_SQL}, t.agent_id, t.pruned_at FROM stream_groups s JOIN trajectories t ON "
            "t.run_id=s.run_id AND "
            f"t.instance_id=s.instance_id AND t.epoch=s.epoch AND t.part=s.part {REWARDS_JOIN_SQL} "
            f"WHERE {' AND '.join(['s.state=?', 's.stream=?', *where])} ORDER BY s.ready_seq, t.rowid"
        )
        args[:0] = ["delivered", agent_id or ""]
    else:
        sql = (f"SELECT {REWARDED_SQL}, t.agent_id, t.pruned_at FROM trajectories t {REWARDS_JOIN_SQL} "
               f"WHERE {' AND '.join(['1', *where])} ORDER BY t.rowid")
    for blob, cut, head, side, agent, pruned_at in conn.execute(sql, args):
        yield (bytes(with_rewards(blob, cut, head, side)) if pruned_at is None else None), agent


def export(data_dir: Path, out: BinaryIO, run: str | None = None, delivered_only: bool = True,
           statuses: tuple[str, ...] = (), agent_id: str | None = None) -> ExportSummary:
    """Write the selected trajectories to `out`, one JSON object a line, from one snapshot of the store."""
    conn = open_readonly(data_dir)
    try:
        conn.execute("BEGIN")  # one read transaction: runs and records come from the same snapshot
        run_ids = select_runs(conn, run)
        n = pruned = 0
        by_role: Counter[str] = Counter()
        images: set[str] = set()
        for blob, role in iter_records(conn, run_ids[0] if run is not None else None, delivered_only, statuses,
                                       agent_id):
            if blob is None:
                pruned += 1
                continue
            out.write(blob)
            out.write(b"\n")
            n += 1
            if b'"images":[' in blob:  # a record's image list: each one's sha256 (`schemas.ImageRef`)
                images.update(m.decode() for m in _IMAGE_SHA.findall(blob))
            if role is not None:
                by_role[role] += 1
        conn.execute("COMMIT")
    except sqlite3.Error as e:
        raise ExportError(f"reading {data_dir / DB_NAME} failed: {e}") from None
    finally:
        conn.close()
    return ExportSummary(n, tuple(run_ids), dict(sorted(by_role.items())), pruned, frozenset(images))


def iter_eval_lines(conn: sqlite3.Connection, records: bool, datasets: tuple[str, ...] = ()) -> Iterator[bytes]:
    """Eval summaries, one per (dataset, version), oldest version first; or with `records` every eval
    trajectory (with `extra_info.eval_dataset`, `eval_version`, `eval_sample`), in the same order."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='evals'").fetchone() is None:
        return  # a store written before evals existed holds none
    summaries = sorted(read_summaries(conn, -1, list(datasets) or None), key=lambda s: (s.version, s.dataset))
    for summary in summaries:
        if records:
            yield from read_records(conn, summary.dataset, summary.version, summary.n_samples)
        else:
            yield orjson.dumps(summary.as_dict())


def export_evals(data_dir: Path, out: BinaryIO, records: bool = False, datasets: tuple[str, ...] = ()) -> int:
    """Write eval summaries (or eval trajectories) to `out`, one JSON object a line; returns the lines written."""
    conn = open_readonly(data_dir)
    n = 0
    try:
        conn.execute("BEGIN")
        for line in iter_eval_lines(conn, records, datasets):
            out.write(line)
            out.write(b"\n")
            n += 1
        conn.execute("COMMIT")
    except sqlite3.Error as e:
        raise ExportError(f"reading {data_dir / DB_NAME} failed: {e}") from None
    finally:
        conn.close()
    return n


def export_to_file(data_dir: Path, path: Path, run: str | None = None, delivered_only: bool = True,
                   statuses: tuple[str, ...] = (), agent_id: str | None = None) -> ExportSummary:
    """`export` into `path`, which appears complete or not at all (written beside it, then renamed), with the
    images its records name in `images/` beside it (`<sha256>.<png|jpg|...>`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as f:
            summary = export(data_dir, f, run, delivered_only, statuses, agent_id)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    copy_images(data_dir, summary.images, path.parent / "images")
    return summary


def copy_images(data_dir: Path, shas: frozenset[str], folder: Path) -> None:
    """The named images of the store, copied into `folder` under their hash and kind (existing ones kept)."""
    store = ImageStore(data_dir / "images")
    for sha in sorted(shas):
        image = store.get(sha)
        if image is None:
            continue  # a record written with images the store never held (`/buffer/write`)
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"{sha}.{image.media_type.removeprefix('image/').replace('jpeg', 'jpg')}"
        if not target.exists():
            target.write_bytes(image.data)


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `rollout-buffer export`."""
    p = argparse.ArgumentParser(
        prog="rollout-buffer export",
        description="Write stored trajectories as JSONL (one record a line) for inspection or SFT.\n"
        "The store is opened read-only: safe while the server runs.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data-dir", type=Path, required=True, help="the server's --data-dir (holds buffer.sqlite)")
    p.add_argument("--out", required=True, help="output .jsonl file, or - for stdout")
    p.add_argument("--run", default=None, help="one run id, or 'latest' (default: every run)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--delivered", dest="delivered_only", action="store_true", default=True,
                       help="only groups the trainer consumed (acked, or taken without a lease); the default; "
                            "with --agent-id, what that role's stream consumed")
    which.add_argument("--all", dest="delivered_only", action="store_false",
                       help="every stored trajectory: failed ones, filtered and unfinished groups too")
    p.add_argument("--status", action="append", choices=STATUSES, default=[],
                   help="keep only trajectories with this status (repeatable)")
    evals = p.add_mutually_exclusive_group()
    evals.add_argument("--eval", action="store_true",
                       help="eval results instead: one summary per dataset and version (mean reward, pass@k, "
                            "truncation rate, mean response length)")
    evals.add_argument("--eval-records", action="store_true", help="eval trajectories instead")
    p.add_argument("--dataset", action="append", default=[], help="with --eval/--eval-records: only this eval "
                                                                 "dataset (repeatable)")
    p.add_argument("--agent-id", default=None,
                   help="only this role's records (extra_info.agent_id, e.g. planner or actor)")
    return p


def main(argv: list[str]) -> None:
    """Entry point of `rollout-buffer export`."""
    args = build_parser().parse_args(argv)
    err = Console(stderr=True, highlight=False, markup=False)
    statuses = tuple(args.status)
    if args.eval or args.eval_records:
        _main_evals(args, err)
        return
    try:
        if args.out == "-":
            summary = export(args.data_dir, sys.stdout.buffer, args.run, args.delivered_only, statuses,
                             args.agent_id)
            sys.stdout.flush()
        else:
            summary = export_to_file(args.data_dir, Path(args.out), args.run, args.delivered_only, statuses,
                                     args.agent_id)
    except ExportError as e:
        err.print(f"error: {e}", style="red")
        raise SystemExit(2) from None
    what = "delivered" if args.delivered_only else "stored"
    runs = summary.run_ids[0] if len(summary.run_ids) == 1 else f"{len(summary.run_ids)} runs"
    roles = ", ".join(f"{role} {n}" for role, n in summary.by_role.items())
    err.print(f"wrote {summary.records} {what} trajectories from {runs} to {args.out}"
              + (f" (by role: {roles})" if roles else "")
              + (f"; {summary.pruned} more were pruned to their facts (serve --prune-delivered-after-h) and are "
                 "not written" if summary.pruned else "")
              + (f"; their {len(summary.images)} images in {Path(args.out).parent / 'images'}"
                 if summary.images and args.out != "-" else ""))


def _main_evals(args: argparse.Namespace, err: Console) -> None:
    datasets = tuple(args.dataset)
    try:
        if args.out == "-":
            n = export_evals(args.data_dir, sys.stdout.buffer, args.eval_records, datasets)
            sys.stdout.flush()
        else:
            path = Path(args.out)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            try:
                with tmp.open("wb") as f:
                    n = export_evals(args.data_dir, f, args.eval_records, datasets)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
    except ExportError as e:
        err.print(f"error: {e}", style="red")
        raise SystemExit(2) from None
    err.print(f"wrote {n} eval {'trajectories' if args.eval_records else 'summaries'} to {args.out}")
