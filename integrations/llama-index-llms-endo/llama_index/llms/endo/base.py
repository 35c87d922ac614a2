"""`llama_index.llms.endo`: the local backbone as a LlamaIndex LLM (complete, chat, streaming).

It shares the loaded model with `EndoRetriever` and `EndoCompressor` (all default to `Backbone.default()`), so a
pipeline holds one copy of the weights. Generation uses the model's own chat template, greedy by default.
"""
from __future__ import annotations

from typing import Any, Sequence

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseGen, CompletionResponse,
                                              CompletionResponseGen, LLMMetadata, MessageRole)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from endo_retrieval.attention import get_backend
from endo_retrieval.model.backbone import Backbone


def to_chat(messages: Sequence[ChatMessage]) -> list[dict]:
    """LlamaIndex messages -> the role/content dicts of the model's chat template (tool results read as user text)."""
    roles = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}
    return [{"role": roles.get(m.role, "user"), "content": m.content or ""} for m in messages]


class EndoLLM(CustomLLM):
    """The endo backbone (SmolLM2-135M-Instruct unless another is given) as a LlamaIndex LLM."""

    max_new_tokens: int = Field(default=256, gt=0, description="tokens generated at most per call")
    attention: Any = Field(default=None, description="None (the model's own attention) or a decode-time backend: "
                           "'reattention', 'prhs', 'completion', 'dense', or an instance such as ReAttention()")
    _backbone: Backbone = PrivateAttr()

    def __init__(self, backbone: Backbone | None = None, max_new_tokens: int = 256, attention: Any = None,
                 **kwargs: Any):
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

    def _generate(self, prompt_or_messages, stream: bool = False):
        return self._backbone.generate(self._messages(prompt_or_messages), max_new_tokens=self.max_new_tokens,
                                       stream=stream, attention=get_backend(self.attention))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(text=self._generate(prompt))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        pieces = self._generate(prompt, stream=True)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield CompletionResponse(text=text, delta=piece)

        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=self._generate(messages)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        pieces = self._generate(messages, stream=True)

        def gen() -> ChatResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=piece)

        return gen()


__all__ = ["EndoLLM"]
