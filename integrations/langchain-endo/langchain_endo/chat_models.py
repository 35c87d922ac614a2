"""The local backbone as a LangChain chat model (greedy, streamed token by token), sharing the loaded model with
`EndoRetriever` and `EndoDocumentCompressor`.

Tools: a 135M-parameter model does not write reliable tool-call JSON, so `bind_tools` follows a fixed
retrieve-then-answer policy instead of free-form calls: on a new user turn the model calls the bound tool (one tool,
or the one named by `tool_choice`) with the user's message as its one text argument; once the tool's results are
in, it answers the question from them. That is the loop `create_retriever_tool` agents run. For the same reason it
offers no structured output: `with_structured_output` raises NotImplementedError rather than fill a schema with
text the model did not write as one.

Decoding is greedy unless `temperature` is above 0; then the model's generate samples at that temperature (seed
torch, `torch.manual_seed`, for repeatable samples). Attention backends decode greedily and refuse a temperature.
An answer ends at the chat template's end-of-turn token, at a `stop` sequence (the model stops there too), or where
it starts repeating itself (`stop_on_repeat`); `stream` yields the text as the tokens come. `compress_to=T`
compresses a longer prompt's context first (a long prompt's prefill dominates on a CPU). What happened (prompt
tokens, compression and its seconds, seconds to the first token, new tokens, why it stopped) is in the message's
`response_metadata["generation"]`.
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, Callable, Iterator, Sequence

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import (AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage,
                                     ToolMessage)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field, PrivateAttr

from endo_retrieval.integrations import GenerationSettings
from endo_retrieval.model.backbone import Backbone


def _text(message: BaseMessage) -> str:
    return message.content if isinstance(message.content, str) else message.text


def to_chat(messages: Sequence[BaseMessage]) -> list[dict]:
    """LangChain messages -> the model's chat-template turns. Tool results after the last user turn become the
    context of that turn (the model answers from them); tool-call-only assistant turns are dropped."""
    last_user = max((i for i, m in enumerate(messages) if isinstance(m, HumanMessage)), default=-1)
    results = [_text(m) for m in messages[last_user + 1:] if isinstance(m, ToolMessage)]
    turns = []
    for i, m in enumerate(messages):
        if isinstance(m, SystemMessage):
            turns.append({"role": "system", "content": _text(m)})
        elif isinstance(m, HumanMessage):
            content = _text(m)
            if i == last_user and results:
                context = "\n\n".join(results)
                content = f"Context:\n{context}\n\nAnswer the question using the context.\nQuestion: {content}"
            turns.append({"role": "user", "content": content})
        elif isinstance(m, AIMessage) and _text(m):
            turns.append({"role": "assistant", "content": _text(m)})
    return turns


def _cut_at_stop(text: str, stop: list[str] | None) -> str:
    cuts = [text.index(s) for s in stop or () if s in text]
    return text[:min(cuts)] if cuts else text


def _stop_prefix(text: str, stop: list[str] | None) -> int:
    """The length of the longest end of `text` that begins some stop sequence."""
    return max((n for s in stop or () for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
               default=0)


class ChatEndo(GenerationSettings, BaseChatModel):
    """The endo backbone (SmolLM2-135M-Instruct unless another is given) as a LangChain chat model."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    temperature: float | None = Field(default=None, ge=0, description="None or 0: greedy (the default); above 0: "
                                      "sample at this temperature (also `invoke(..., temperature=...)`)")
    backbone: Any = Field(default=None, exclude=True, repr=False)
    _backbone: Backbone = PrivateAttr()

    def model_post_init(self, __context: Any) -> None:
        self._backbone = Backbone.of(self.backbone)  # a loaded backbone, a model folder or GGUF path, or None
        self._sampling(self.temperature)  # a temperature with an attention backend fails here, not at the first call

    @property
    def _llm_type(self) -> str:
        return "endo"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self._backbone.model_id, "model_hash": self._backbone.model_hash,
                "max_new_tokens": self.max_new_tokens, "temperature": self.temperature}

    def _sampling(self, temperature) -> dict:
        """The model's generate keywords for `temperature`: none (greedy) for None or 0, else sampling."""
        if temperature is None or temperature == 0:
            return {}
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0 or None: greedy), got {temperature!r}.")
        if self.attention is not None:
            raise ValueError(f"ChatEndo(attention={self.attention!r}) decodes greedily and cannot sample; drop "
                             "temperature (or set it to 0), or drop attention to sample with the model's own.")
        return {"do_sample": True, "temperature": float(temperature)}

    def with_structured_output(self, schema, *, include_raw: bool = False, **kwargs: Any):
        raise NotImplementedError(
            "ChatEndo has no structured output: the small local model does not write reliable JSON, and its tool "
            "policy only copies the user's message into a tool's one text argument. Ask it for text and parse that, "
            "or use a larger chat model for structured output.")

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        schemas = [convert_to_openai_tool(t)["function"] for t in tools]
        names = [s["name"] for s in schemas]
        if tool_choice in (None, "auto", "any", "required") and len(schemas) > 1:
            raise ValueError(f"ChatEndo calls one tool per turn; with several tools ({', '.join(names)}) pass "
                             "tool_choice='<tool name>'.")
        if tool_choice not in (None, "auto", "any", "required", "none") and tool_choice not in names:
            raise ValueError(f"tool_choice {tool_choice!r} is not one of the bound tools: {', '.join(names)}.")
        return super().bind(tools=schemas, tool_choice=tool_choice, **kwargs)

    def _tool_call(self, messages: list[BaseMessage], tools: list[dict] | None, tool_choice: str | None
                   ) -> AIMessage | None:
        """The retrieve step of the policy: call the tool on a user turn that has no tool results yet."""
        if not tools or tool_choice == "none" or not messages or not isinstance(messages[-1], HumanMessage):
            return None
        tool = next(t for t in tools if tool_choice in (None, "auto", "any", "required") or t["name"] == tool_choice)
        params = tool.get("parameters", {})
        strings = [p for p, spec in params.get("properties", {}).items() if spec.get("type") == "string"]
        required = params.get("required", strings)
        if len(strings) != 1 or any(p not in strings for p in required):
            raise ValueError(f"ChatEndo fills a tool's one text argument with the user's message; tool "
                             f"{tool['name']!r} takes {list(params.get('properties', {}))}.")
        call = {"name": tool["name"], "args": {strings[0]: _text(messages[-1])}, "id": f"call_{len(messages)}",
                "type": "tool_call"}
        return AIMessage(content="", tool_calls=[call])

    def _answer(self, messages: list[BaseMessage], stream: bool, stats: dict, **kwargs: Any):
        """The backbone's answer to `messages` (text, or with stream=True an iterator of its pieces)."""
        sampling = self._sampling(kwargs.get("temperature", self.temperature))
        return self._backbone.generate(to_chat(messages), stream=stream, **sampling, **self.generation_options(stats))

    def _pieces(self, messages: list[BaseMessage], stop: list[str] | None, stats: dict, **kwargs: Any
                ) -> Iterator[str]:
        """The answer's text as it comes, up to the first stop sequence (closing the model's stream there)."""
        pieces = self._answer(messages, True, stats, **kwargs)
        held = ""  # text that may be the start of a stop sequence, shown once the next pieces say it is not
        with contextlib.closing(pieces):
            for piece in pieces:
                held += piece
                cut = _cut_at_stop(held, stop)
                if len(cut) < len(held):  # a stop sequence: the answer ends before it
                    if cut:
                        yield cut
                    stats["stopped"] = "stop_sequence"
                    return
                keep = _stop_prefix(held, stop)
                if len(held) > keep:
                    yield held[:len(held) - keep]
                    held = held[len(held) - keep:]
        if held:
            yield held

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, tools: list[dict] | None = None,
                  tool_choice: str | None = None, **kwargs: Any) -> ChatResult:
        message = self._tool_call(messages, tools, tool_choice)
        stats: dict = {}
        if message is None:  # with stop sequences, read as a stream: the model stops at the first
            text = "".join(self._pieces(messages, stop, stats, **kwargs)) if stop else \
                self._answer(messages, False, stats, **kwargs)
            message = AIMessage(content=text, response_metadata={"generation": stats})
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, tools: list[dict] | None = None,
                tool_choice: str | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        call = self._tool_call(messages, tools, tool_choice)
        if call is not None:
            yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[
                {"name": c["name"], "args": json.dumps(c["args"]), "id": c["id"], "index": 0}
                for c in call.tool_calls]))
            return
        stats: dict = {}
        for piece in self._pieces(messages, stop, stats, **kwargs):
            if run_manager:
                run_manager.on_llm_new_token(piece)
            yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
        # a last empty chunk carries what happened, as chat models put their finish reason in one
        yield ChatGenerationChunk(message=AIMessageChunk(content="", response_metadata={"generation": stats}))


__all__ = ["ChatEndo", "to_chat"]
