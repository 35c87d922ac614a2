"""`endo mcp`: the server speaks MCP over stdio; tested with the official SDK's own client."""
from __future__ import annotations

import asyncio
import json
import sys

import pytest

from endo_retrieval.methods import DEFAULT_METHOD

pytest.importorskip("mcp")
from mcp import Client, StdioServerParameters  # noqa: E402

FACTS = [{"doc_id": "ship", "text": "The research ship Albatross carries twelve scientists. Its home port is Gdansk "
                                    "on the Baltic coast. It was launched in 1988.", "metadata": {"kind": "ship"}},
         {"doc_id": "cafe", "text": "The Orion cafe serves espresso and cardamom buns. It opens at seven in the "
                                    "morning every weekday. Its owner is Jonas Berg."}]


def server(*args: str) -> StdioServerParameters:
    return StdioServerParameters(command=sys.executable, args=["-m", "endo_retrieval.cli.mcp_server", *args])


def structured(result) -> object:
    assert not result.is_error, result.content
    return result.structured_content["result"]


def test_parser_and_bad_folder(tmp_path):
    import argparse

    from endo_retrieval.cli import mcp_server

    args = mcp_server.add_arguments(argparse.ArgumentParser()).parse_args(["--index", str(tmp_path), "--k", "2"])
    assert (args.index, args.k, args.method) == (str(tmp_path), 2, DEFAULT_METHOD)
    with pytest.raises(ValueError, match="holds no endo index"):
        mcp_server.run(args)  # an existing folder that is not an index is refused before serving


@pytest.mark.slow
def test_search_and_add_documents_over_stdio(tmp_path):
    folder = tmp_path / "idx"

    async def first_session():
        async with Client(server("--index", str(folder), "--k", "2")) as client:
            names = {t.name for t in (await client.list_tools()).tools}
            assert names == {"search_evidence", "add_documents", "list_documents"}
            empty = await client.call_tool("search_evidence", {"question": "Where is the port?"})
            assert empty.is_error and "empty" in empty.content[0].text  # a clear message, not a crash
            added = await client.call_tool("add_documents", {"documents": FACTS})
            assert not added.is_error and added.structured_content == {"added": ["ship", "cafe"], "skipped": []}
            again = await client.call_tool("add_documents", {"documents": FACTS[:1]})
            assert again.is_error and "Duplicate document id" in again.content[0].text
            return structured(await client.call_tool("search_evidence",
                                                     {"question": "Where is the home port of the Albatross?"}))

    hits = asyncio.run(first_session())
    assert 1 <= len(hits) <= 2
    ship = next(h for h in hits if h["doc_id"] == "ship")
    assert "Gdansk" in ship["text"] and ship["metadata"] == {"kind": "ship"}
    assert FACTS[0]["text"][ship["char_start"]:ship["char_end"]] == ship["text"]

    async def second_session():  # a new server process serves what the first one saved
        async with Client(server("--index", str(folder))) as client:
            ids = structured(await client.call_tool("list_documents", {}))
            again = structured(await client.call_tool("search_evidence",
                                                      {"question": "Where is the home port of the Albatross?",
                                                       "k": 2}))
            return ids, again

    ids, again = asyncio.run(second_session())
    assert ids == ["ship", "cafe"] and json.dumps(again) == json.dumps(hits)
