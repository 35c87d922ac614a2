"""`llama_index.llms.endo`: the local backbone as a LlamaIndex LLM (complete, chat, streaming).

It shares the loaded model with `EndoRetriever` and `EndoCompressor` (all default to `Backbone.default()`), so a
pipeline holds one copy of the weights. Generation uses the model's own chat template, greedy, and ends at the
template's end-of-turn token or where the answer starts repeating itself (`stop_on_repeat`); `stream_complete` and
`stream_chat` yield the text as the tokens come. `compress_to=T` compresses a longer prompt's context first (a long
prompt's prefill dominates on a CPU). Each response's `additional_kwargs["generation"]` says what happened (prompt
tokens, compression and its seconds, seconds to the first token, new tokens, why it stopped).
"""
from __future__ import annotations

from typing import Any, Sequence

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseGen, CompletionResponse,
                                              CompletionResponseGen, LLMMetadata, MessageRole)
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from endo_retrieval.integrations import DEFAULT_MAX_NEW_TOKENS, GenerationSettings
from endo_retrieval.model.backbone import Backbone


def to_chat(messages: Sequence[ChatMessage]) -> list[dict]:
    """LlamaIndex messages -> the role/content dicts of the model's chat template (tool results read as user text)."""
    roles = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}
    return [{"role": roles.get(m.role, "user"), "content": m.content or ""} for m in messages]


class EndoLLM(GenerationSettings, CustomLLM):
    """The endo backbone (SmolLM2-135M-Instruct unless another is given) as a LlamaIndex LLM."""

    _backbone: Backbone = PrivateAttr()

    def __init__(self, backbone: Backbone | None = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 attention: Any = None, **kwargs: Any):
        super().__init__(max_new_tokens=max_new_tokens, attention=attention, **kwargs)
        self._backbone = Backbone.of(backbone)  # a loaded backbone, a model folder or GGUF path, or None

    @property
    def backbone(self) -> Backbone:
        return self._backbone

    @classmethod
    def class_name(cls) -> str:
        return "EndoLLM"

    @property
    def metadata(self) -> LLMMetadata:
        bb = self._backbone
        return LLMMetadata(context_window=bb.max_position or DEFAULT_CONTEXT_WINDOW, num_output=self.max_new_tokens,
                           is_chat_model=True, model_name=bb.model_id)

    def _messages(self, prompt_or_messages) -> list[dict]:
        msgs = [{"role": "user", "content": prompt_or_messages}] if isinstance(prompt_or_messages, str) \
            else to_chat(prompt_or_messages)
        if self.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def _generate(self, prompt_or_messages, stream: bool = False, stats: dict | None = None):
        return self._backbone.generate(self._messages(prompt_or_messages), stream=stream,
                                       **self.generation_options(stats))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        stats: dict = {}
        text = self._generate(prompt, stats=stats)
        return CompletionResponse(text=text, additional_kwargs={"generation": stats})

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stats: dict = {}
        pieces = self._generate(prompt, stream=True, stats=stats)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield CompletionResponse(text=text, delta=piece, additional_kwargs={"generation": stats})

        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        stats: dict = {}
        text = self._generate(messages, stats=stats)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                            additional_kwargs={"generation": stats})

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stats: dict = {}
        pieces = self._generate(messages, stream=True, stats=stats)

        def gen() -> ChatResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=piece,
                                   additional_kwargs={"generation": stats})

        return gen()


__all__ = ["EndoLLM"]
