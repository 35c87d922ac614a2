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
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from endo_retrieval.attention import get_backend
from endo_retrieval.model.backbone import Backbone

# A RAG answer is a sentence or a short paragraph: on HotpotQA questions the default model's answers that end by
# themselves take at most ~60 tokens (docs/generation.md), and on a CPU every new token costs a forward of the
# model, so 128 bounds the time of an answer that would not end while leaving room for a few sentences.
DEFAULT_MAX_NEW_TOKENS = 128
# an answer ends before repeating a run of this many tokens (about six words) or a sentence it already wrote
DEFAULT_STOP_ON_REPEAT = 8


def to_chat(messages: Sequence[ChatMessage]) -> list[dict]:
    """LlamaIndex messages -> the role/content dicts of the model's chat template (tool results read as user text)."""
    roles = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}
    return [{"role": roles.get(m.role, "user"), "content": m.content or ""} for m in messages]


class EndoLLM(CustomLLM):
    """The endo backbone (SmolLM2-135M-Instruct unless another is given) as a LlamaIndex LLM."""

    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, gt=0, description="tokens generated at most per call")
    attention: Any = Field(default=None, description="None (the model's own attention) or a decode-time backend: "
                           "'reattention', 'prhs', 'completion', 'dense', or an instance such as ReAttention()")
    stop_on_repeat: int = Field(default=DEFAULT_STOP_ON_REPEAT, ge=0, description="the answer ends before it repeats "
                                "a run of this many tokens or a sentence it already wrote (0: off)")
    repetition_penalty: float = Field(default=1.0, gt=0, description="transformers' repetition penalty over the "
                                      "answer's own tokens (1: none)")
    no_repeat_ngram_size: int = Field(default=0, ge=0, description="transformers' n-gram block over the answer's own "
                                      "tokens: no n-gram of this size twice (0: none)")
    compress_to: int | None = Field(default=None, gt=0, description="a prompt longer than this many tokens has its "
                                    "context compressed first (endo_retrieval.compress); None: never")
    compress_method: str | None = Field(default=None, description="the compression method (None: the default)")
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
        options = dict(stop_on_repeat=self.stop_on_repeat or None, compress_to=self.compress_to,
                       compress_method=self.compress_method, stats=stats)
        if self.repetition_penalty != 1.0:
            options["repetition_penalty"] = self.repetition_penalty
        if self.no_repeat_ngram_size:
            options["no_repeat_ngram_size"] = self.no_repeat_ngram_size
        return self._backbone.generate(self._messages(prompt_or_messages), max_new_tokens=self.max_new_tokens,
                                       stream=stream, attention=get_backend(self.attention), **options)

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
