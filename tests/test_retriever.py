"""The BM25 retrieval server: Search-R1's protocol over real HTTP, the on-disk index cache, the search client."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from importlib import resources
from pathlib import Path

import httpx
import orjson
import pytest
from servers import Server, free_port

from generators.retriever import BM25Index, corpus_documents
from generators.search_client import SearchClient, SearchError, hit_documents, retrieve_url

CORPUS = Path(str(resources.files("generators") / "data" / "search_corpus.jsonl"))
DEMO = Path(str(resources.files("generators") / "data" / "search_demo.jsonl"))


def title(doc: dict) -> str:
    return doc["contents"].split("\n", 1)[0].strip('"')


def retrieve(srv: Server, **body) -> dict:
    resp = httpx.post(f"{srv.url}/retrieve", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_retrieve_speaks_search_r1_protocol_with_scores(retriever):
    out = retrieve(retriever, queries=["capital city of Australia", "who painted the Mona Lisa"], topk=3,
                   return_scores=True)
    assert set(out) == {"result"} and len(out["result"]) == 2, "one hit list per query, in order"
    australia, mona_lisa = out["result"]
    assert len(australia) == 3
    for hit in australia:
        assert set(hit) == {"document", "score"} and isinstance(hit["score"], float)
        assert {"id", "contents"} <= set(hit["document"])
        assert hit["document"]["contents"].startswith('"') and "\n" in hit["document"]["contents"]
    assert [h["score"] for h in australia] == sorted((h["score"] for h in australia), reverse=True)
    assert title(australia[0]["document"]) == "Canberra"
    assert australia[0]["document"]["contents"].startswith('"Canberra"\nCanberra is the capital city of Australia')
    assert title(mona_lisa[0]["document"]) == "Leonardo da Vinci"


def test_retrieve_without_scores_returns_bare_documents_and_default_topk(retriever):
    out = retrieve(retriever, queries=["largest planet in the Solar System"])
    hits = out["result"][0]
    assert len(hits) == 3, "the server's --topk (3) when the request gives none"
    assert all(set(h) == {"id", "contents"} for h in hits), "Search-R1 returns bare documents without scores"
    assert title(hits[0]) == "Jupiter"


def test_queries_without_known_terms_find_nothing(retriever):
    out = retrieve(retriever, queries=["", "the of and", "xylophonic quasar zebra"], topk=5, return_scores=True)
    assert out["result"] == [[], [], []]


def test_topk_larger_than_corpus_is_clamped_and_bad_requests_are_refused(retriever):
    n = httpx.get(f"{retriever.url}/health").json()["documents"]
    assert n == sum(1 for line in CORPUS.read_text().splitlines() if line.strip())
    hits = retrieve(retriever, queries=["capital"], topk=1000)["result"][0]
    assert 0 < len(hits) < n
    assert httpx.post(f"{retriever.url}/retrieve", json={"queries": ["x"], "topk": 0}).status_code == 422
    assert httpx.post(f"{retriever.url}/retrieve", json={"topk": 3}).status_code == 422


def test_every_demo_question_finds_its_answer_first(retriever):
    """The sim engine's search policy answers with the first document's title: the demo data relies on it."""
    rows = [orjson.loads(line) for line in DEMO.read_bytes().splitlines() if line.strip()]
    out = retrieve(retriever, queries=[r["question"].rstrip("?") for r in rows], topk=3)
    for row, hits in zip(rows, out["result"], strict=True):
        assert title(hits[0]) == row["golden_answers"][0], row["question"]
        assert len(hits) >= 2, f"{row['question']}: a second document gives the wrong answers"


def test_index_is_cached_on_disk_and_rebuilt_for_a_changed_corpus(tmp_path, monkeypatch):
    corpus = tmp_path / "c.jsonl"
    rows = [{"title": "Alpha", "text": "alpha particles"}, {"id": "b", "contents": '"Beta"\nbeta rays'}]
    corpus.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    index_dir = tmp_path / "index"
    first = BM25Index.open(corpus, index_dir)
    (beta,) = first.search(["beta"], 3)
    assert [doc for doc, _ in beta] == [{"id": "b", "contents": '"Beta"\nbeta rays'}] and beta[0][1] > 0
    assert first.search(["alpha"], 3)[0][0][0] == {"title": "Alpha", "text": "alpha particles", "id": "0",
                                                    "contents": '"Alpha"\nalpha particles'}

    def no_build(*_args):
        raise AssertionError("the cached index should have been loaded")

    monkeypatch.setattr("generators.retriever._build", no_build)
    again = BM25Index.open(corpus, index_dir)
    assert again.folder == first.folder and again.num_documents == 2
    monkeypatch.undo()
    corpus.write_text('{"title": "Gamma", "text": "gamma rays"}\n')
    changed = BM25Index.open(corpus, index_dir)
    assert changed.folder != first.folder and changed.num_documents == 1
    assert sorted(p.name for p in index_dir.iterdir()) == sorted([first.folder.name, changed.folder.name])


def test_bad_corpus_rows_name_the_line(tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"contents": "\\"A\\"\\nok"}\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match="line 2"):
        list(corpus_documents(corpus))
    out = subprocess.run([sys.executable, "-m", "rollout_buffer", "retriever", "--corpus", str(corpus),
                          "--index-dir", str(tmp_path / "i"), "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "line 2" in out.stderr


def test_hits_with_or_without_scores_give_documents():
    doc = {"id": "1", "contents": '"T"\nx'}
    assert hit_documents([{"document": doc, "score": 1.5}]) == [doc]
    assert hit_documents([doc]) == [doc]
    with pytest.raises(SearchError):
        hit_documents([["not", "an", "object"]])
    assert retrieve_url("http://h:8000") == "http://h:8000/retrieve"
    assert retrieve_url("http://h:8000/retrieve") == "http://h:8000/retrieve"


def test_client_shares_one_request_per_query_and_caches(retriever):
    async def scenario() -> tuple[list, list, list]:
        client = SearchClient(retriever.url, topk=2, concurrency=4)
        try:
            first = await asyncio.gather(*(client.search("Who discovered penicillin") for _ in range(8)))
            again = await client.search(" Who  discovered penicillin")  # same words, other spacing
            other = await client.search("Who invented the telephone")
            return first, [again], [other, client.stats]
        finally:
            await client.aclose()

    before = httpx.get(f"{retriever.url}/stats").json()["queries"]
    first, (again,), (other, stats) = asyncio.run(scenario())
    after = httpx.get(f"{retriever.url}/stats").json()["queries"]
    assert after - before == 2, "eight concurrent and one later identical search cost one request"
    docs = first[0][0]
    assert len(docs) == 2 and title(docs[0]) == "Alexander Fleming"
    assert [cached for _, cached in first].count(False) == 1
    assert again == (docs, True)
    assert title(other[0][0]) == "Alexander Graham Bell" and other[1] is False
    assert (stats.hits, stats.misses, stats.errors) == (8, 2, 0)


def test_client_reports_a_down_server_and_does_not_cache_the_failure():
    port = free_port()

    async def scenario() -> tuple[str, str, int]:
        client = SearchClient(f"http://127.0.0.1:{port}", retries=1, timeout_s=2)
        try:
            with pytest.raises(SearchError) as first:
                await client.search("anything")
            with pytest.raises(SearchError) as second:
                await client.search("anything")
            return str(first.value), str(second.value), client.stats.misses
        finally:
            await client.aclose()

    first, second, misses = asyncio.run(scenario())
    assert "unreachable" in first and "unreachable" in second
    assert misses == 2, "a failed search is tried again next time, not served from the cache"
