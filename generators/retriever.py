"""`rollout-buffer retriever`: a Search-R1 retrieval server over a BM25 index of a JSONL corpus.

It speaks Search-R1's retrieval protocol, so Search-R1's own (dense) retrieval server is a drop-in
replacement and Search-R1 / slime clients can use this one:

    POST /retrieve {"queries": ["...", ...], "topk": 3, "return_scores": true}
    → {"result": [[{"document": {"id": "7", "contents": "\\"Title\\"\\ntext"}, "score": 12.3}, ...], ...]}

one list per query, best first; with `"return_scores": false` (Search-R1's default) each hit is the bare
document. Only documents sharing a term with the query are returned, so a list may be shorter than `topk`.

Corpus rows are Search-R1's (`{"id": "0", "contents": "\\"Title\\"\\ntext"}`, as in its wiki-18 corpus) or
`{"title": ..., "text": ...}`; other keys are returned as they are. The index (built with bm25s) is cached on
disk under `--index-dir`, keyed by the corpus content, so a restart on the same corpus loads it instead of
building it again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel, Field
from starlette.responses import Response

from rollout_buffer.generator_api import iter_json_objects

log = logging.getLogger(__name__)

Document = dict[str, Any]

DEFAULT_PORT = 8000  # Search-R1's
DEFAULT_TOPK = 3
MAX_QUERIES = 4096
# Part of the cache key: bump when the stored index or its tokenization changes.
INDEX_FORMAT = 1
_STOPWORDS = "en"
_CORPUS_FILE = "corpus.jsonl"


def default_index_dir() -> Path:
    """Where indexes are cached unless `--index-dir` says otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rollout-buffer" / "bm25"


def corpus_documents(path: Path) -> Iterator[Document]:
    """The corpus rows as documents with an `id` (the row number when absent) and Search-R1's `contents`.

    A bad row raises ValueError naming the file and the line.
    """
    for lineno, row in iter_json_objects(path, "corpus"):
        if isinstance(row.get("contents"), str):
            contents = row["contents"]
        elif isinstance(row.get("text"), str):
            contents = f'"{row.get("title") or ""}"\n{row["text"]}'
        else:
            raise ValueError(f"corpus: {path} line {lineno}: needs 'contents', or 'title' and 'text'")
        yield {**row, "id": str(row.get("id", lineno - 1)), "contents": contents}


def index_key(corpus: Path) -> str:
    """Cache key of the corpus's index: a digest of the corpus bytes and of how it is indexed."""
    digest = hashlib.blake2b(f"format={INDEX_FORMAT};stopwords={_STOPWORDS}\n".encode(), digest_size=16)
    with corpus.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _tokenize(texts: list[str]) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(texts, stopwords=_STOPWORDS, return_ids=False, show_progress=False)


@dataclass
class BM25Index:
    """A loaded BM25 index and its documents (memory-mapped from the cache folder)."""

    retriever: Any  # bm25s.BM25
    documents: Any  # bm25s JsonlCorpus: documents by row
    folder: Path

    @property
    def num_documents(self) -> int:
        return len(self.documents)

    @classmethod
    def open(cls, corpus: Path, index_dir: Path) -> BM25Index:
        """Load the cached index of `corpus`, building and caching it first when there is none."""
        index_dir.mkdir(parents=True, exist_ok=True)
        folder = index_dir / f"{corpus.stem}-{index_key(corpus)}"
        if not (folder / _CORPUS_FILE).exists():
            _build(corpus, index_dir, folder)
        else:
            log.info("loading cached BM25 index %s", folder)
        return cls.load(folder)

    @classmethod
    def load(cls, folder: Path) -> BM25Index:
        """Load an index saved by `open`."""
        # bm25s (numpy) is imported here, not at module level: the buffer imports every generators module.
        import bm25s
        from bm25s.utils.corpus import JsonlCorpus

        retriever = bm25s.BM25.load(str(folder), mmap=True, load_corpus=False, show_progress=False)
        return cls(retriever, JsonlCorpus(str(folder / _CORPUS_FILE), show_progress=False), folder)

    def search(self, queries: list[str], topk: int) -> list[list[tuple[Document, float]]]:
        """The best `topk` documents of each query with their scores, leaving out those scoring 0.

        Not thread-safe (the corpus is read through one shared memory map): call it from one thread.
        """
        k = min(topk, self.num_documents)
        found = self.retriever.retrieve(_tokenize(queries), k=k, show_progress=False, n_threads=0)
        return [
            [(self.documents[int(i)], float(s)) for i, s in zip(ids, scores, strict=True) if s > 0]
            for ids, scores in zip(found.documents, found.scores, strict=True)
        ]


def _build(corpus: Path, index_dir: Path, folder: Path) -> None:
    """Index `corpus` into a temporary folder, then move it to `folder` in one step."""
    import bm25s

    start = time.monotonic()
    docs = list(corpus_documents(corpus))
    if not docs:
        raise ValueError(f"corpus {corpus} has no documents")
    log.info("building the BM25 index of %d documents from %s", len(docs), corpus)
    retriever = bm25s.BM25()
    retriever.index(_tokenize([d["contents"] for d in docs]), show_progress=False)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=index_dir))
    try:
        retriever.save(str(tmp), corpus=docs, corpus_name=_CORPUS_FILE, show_progress=False)
        tmp.rename(folder)
    except OSError:
        if not (folder / _CORPUS_FILE).exists():
            raise
        log.info("another process cached the same index first; using it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("BM25 index cached in %s (%.1fs)", folder, time.monotonic() - start)


class RetrieveRequest(BaseModel):
    """Search-R1's `/retrieve` body."""

    queries: list[str] = Field(max_length=MAX_QUERIES)
    topk: int | None = Field(default=None, ge=1, le=1000)
    return_scores: bool = False


@dataclass
class _Counters:
    requests: int = 0
    queries: int = 0


def create_app(index: BM25Index, default_topk: int = DEFAULT_TOPK) -> FastAPI:
    """The retrieval server's app: `POST /retrieve`, `GET /health`, `GET /stats`."""
    # One worker thread: BM25 scoring is CPU work that must stay off the event loop, and the memory-mapped
    # corpus must be read by one thread at a time.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bm25")
    counters = _Counters()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rollout-buffer retriever (BM25)", lifespan=lifespan)

    @app.post("/retrieve")
    async def retrieve(req: RetrieveRequest) -> Response:
        counters.requests += 1
        counters.queries += len(req.queries)
        loop = asyncio.get_running_loop()
        hits = await loop.run_in_executor(executor, index.search, req.queries, req.topk or default_topk)
        if req.return_scores:
            result: list[list[Any]] = [[{"document": d, "score": s} for d, s in q] for q in hits]
        else:
            result = [[d for d, _ in q] for q in hits]
        return Response(orjson.dumps({"result": result}), media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "documents": index.num_documents}

    @app.get("/stats")
    async def stats() -> dict[str, int]:
        return {"requests": counters.requests, "queries": counters.queries}

    return app


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line of `rollout-buffer retriever`."""
    p = argparse.ArgumentParser(
        prog="rollout-buffer retriever", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  rollout-buffer retriever --corpus wiki-18.jsonl --port 8000\n"
        "  rollout-buffer retriever --corpus corpus.jsonl --port 8000 --index-dir /data/bm25 --topk 5",
    )
    p.add_argument("--corpus", type=Path, required=True, help="JSONL corpus (Search-R1's shape, see above)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback only)")
    p.add_argument("--index-dir", type=Path, default=None,
                   help=f"where built indexes are cached (default: {default_index_dir()})")
    p.add_argument("--topk", type=int, default=DEFAULT_TOPK, help="documents per query when a request gives none")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    """Entry point of `rollout-buffer retriever`."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs every query without known terms
    if not args.corpus.is_file():
        raise SystemExit(f"--corpus {args.corpus} is not a file")
    try:
        index = BM25Index.open(args.corpus.resolve(), args.index_dir or default_index_dir())
    except ValueError as e:
        raise SystemExit(str(e)) from None
    log.info("serving %d documents on http://%s:%d/retrieve", index.num_documents, args.host, args.port)
    uvicorn.run(create_app(index, args.topk), host=args.host, port=args.port,
                log_level=args.log_level.lower(), access_log=False)
