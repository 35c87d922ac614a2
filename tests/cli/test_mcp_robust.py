"""`endo mcp` under bad input: malformed JSON-RPC, unknown tools, arguments of the wrong type or huge, document ids
that look like paths, add_documents while searches run. The server answers each with an error and keeps serving;
nothing is written outside its index folder. In-process with the SDK's own client, on the tiny engine."""
import asyncio
import json
import os
import queue
import subprocess
import sys
import threading

import pytest

pytest.importorskip("mcp")
from mcp import Client  # noqa: E402

from endo_retrieval.cli.mcp_server import MAX_QUESTION_CHARS, IndexHolder, build_server  # noqa: E402

from tiny import DOCS, QUESTIONS, load, new_index  # noqa: E402

PATH_IDS = ["../../escape", "/etc/passwd", "..", "a/../../b", "C:\\Windows\\x", "~/.ssh/id", "ix/../../x", "\x00"]


def serve(tmp_path):
    holder = IndexHolder(str(tmp_path / "ix"), "s3-hybrid")
    holder._index = new_index()  # the tiny engine instead of the default model
    return build_server(holder, k=2)


def tree(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


async def call(client, tool, args):
    """(is_error, payload): a tool error or a protocol error, never a dead session."""
    try:
        result = await client.call_tool(tool, args)
    except Exception as err:  # noqa: BLE001 - the SDK raises for protocol-level errors; the session lives on
        return True, str(err)
    return result.is_error, result.structured_content or result.content


def test_bad_calls_get_errors_and_the_server_keeps_serving(tmp_path):
    async def session():
        async with Client(serve(tmp_path)) as client:
            docs = [{"doc_id": k, "text": v} for k, v in DOCS.items()]
            assert (await call(client, "add_documents", {"documents": docs}))[0] is False
            bad = [("no_such_tool", {}), ("search_evidence", {}), ("search_evidence", {"question": 5}),
                   ("search_evidence", {"question": "q?", "k": "many"}),
                   ("search_evidence", {"question": "q?", "k": -3}),
                   ("search_evidence", {"question": "x" * (MAX_QUESTION_CHARS + 1)}),
                   ("search_evidence", {"question": "\ud800?"}), ("search_evidence", {"question": "   "}),
                   ("add_documents", {"documents": "not a list"}), ("add_documents", {"documents": [{"text": "t"}]}),
                   ("add_documents", {"documents": [{"doc_id": "bin", "text": "\x00\x01"}]}),
                   ("add_documents", {"documents": [{"doc_id": "mill", "text": "again"}]}),
                   ("add_documents", {"documents": []})]
            for tool, args in bad:
                is_error, payload = await call(client, tool, args)
                assert is_error, (tool, args, payload)
            huge_k = await call(client, "search_evidence", {"question": QUESTIONS[0], "k": 10**9, "budget": 10**9})
            assert huge_k[0] is False
            return await call(client, "list_documents", {})

    is_error, ids = asyncio.run(session())
    assert not is_error and ids["result"] == list(DOCS)  # nothing half-added by the bad calls
    assert load(tmp_path / "ix").doc_ids == list(DOCS)


def test_ids_that_look_like_paths_write_nothing_outside_the_index(tmp_path):
    (tmp_path / "outside").mkdir()
    before = tree(tmp_path.parent)

    async def session():
        async with Client(serve(tmp_path / "outside")) as client:
            docs = [{"doc_id": i, "text": f"Entry {n}. " + DOCS["ship"]} for n, i in enumerate(PATH_IDS)]
            return await call(client, "add_documents", {"documents": docs})

    is_error, ids = asyncio.run(session())
    assert not is_error and ids == {"added": PATH_IDS, "skipped": []}
    new = set(tree(tmp_path.parent)) - set(before)
    index_dir = os.path.join(tmp_path.name, "outside")
    assert new and all(p.startswith(index_dir + os.sep) for p in new), new
    assert sorted(os.listdir(tmp_path / "outside")) == ["ix"]  # no lock file after a clean exit
    assert load(tmp_path / "outside" / "ix").doc_ids == PATH_IDS


def test_add_documents_skips_texts_that_cannot_be_indexed_and_indexes_the_rest(tmp_path):
    async def session():
        async with Client(serve(tmp_path)) as client:
            docs = [{"doc_id": "ship", "text": DOCS["ship"]}, {"doc_id": "blank", "text": " \n "},
                    {"doc_id": "bin", "text": "PK\x03\x04\x00\x00"}, {"doc_id": "cafe", "text": DOCS["cafe"]}]
            return await call(client, "add_documents", {"documents": docs})

    is_error, result = asyncio.run(session())
    assert not is_error, result
    assert result["added"] == ["ship", "cafe"]
    assert [(s["doc_id"], s["reason"].split()[0]) for s in result["skipped"]] == [("blank", "empty"), ("bin", "binary")]
    assert load(tmp_path / "ix").doc_ids == ["ship", "cafe"]


def test_add_documents_while_searches_run(tmp_path):
    async def session():
        async with Client(serve(tmp_path)) as client:
            await call(client, "add_documents", {"documents": [{"doc_id": "mill", "text": DOCS["mill"]}]})
            searches = [call(client, "search_evidence", {"question": QUESTIONS[i % 3]}) for i in range(12)]
            adds = [call(client, "add_documents", {"documents": [{"doc_id": k, "text": DOCS[k]}]})
                    for k in ("vault", "ship", "cafe")]
            results = await asyncio.gather(*searches[:6], *adds, *searches[6:])
            return results, await call(client, "list_documents", {})

    results, (_, ids) = asyncio.run(session())
    assert all(not is_error for is_error, _ in results), [p for e, p in results if e][:1]
    assert sorted(ids["result"]) == ["cafe", "mill", "ship", "vault"]
    assert sorted(load(tmp_path / "ix").doc_ids) == ["cafe", "mill", "ship", "vault"]


def test_malformed_json_rpc_over_stdio_gets_errors_and_the_server_lives_on():
    proc = subprocess.Popen([sys.executable, "-m", "endo_retrieval.cli.mcp_server"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in ["this is not json", "[1, 2, 3]", '{"jsonrpc": "2.0"}', '{"jsonrpc": "2.0", "id": 1}',
                     '{"jsonrpc": "2.0", "id": 1, "method": "no/such/method"}', "{" * 10000, '"\\ud800"']:
            proc.stdin.write(line + "\n")
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 7, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}) + "\n")
        proc.stdin.flush()
        # a thread reads the replies: select() on the pipe would wait for more bytes while lines it already read
        # sit in the file's buffer, a wait that depended on how the replies happened to arrive
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in iter(proc.stdout.readline, "")] + [lines.put("")],
                         daemon=True).start()
        replies = []
        while not any(r.get("id") == 7 for r in replies):
            try:
                line = lines.get(timeout=120)
            except queue.Empty:
                raise AssertionError(f"no answer to initialize after malformed input; got {replies}") from None
            assert line, f"the server exited (code {proc.poll()}) after malformed input; got {replies}"
            replies.append(json.loads(line))
        assert proc.poll() is None
        assert next(r for r in replies if r.get("id") == 7)["result"]["serverInfo"]["name"] == "endo-retrieval"
    finally:
        proc.kill()
        proc.wait()
