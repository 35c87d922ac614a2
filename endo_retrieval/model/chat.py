"""A backbone's generation, as one part of it (`Backbone.chat`): chat-template prompts, answers one at a time or
many in batches, and the ids that end an answer. The work is generation.py's."""
from __future__ import annotations

import torch

from endo_retrieval.model import generation


class Chat:
    def __init__(self, backbone):
        self.backbone = backbone

    def ids(self, prompt_or_messages, system: str | None = None) -> torch.Tensor:
        """The chat template's token ids of a prompt (or messages), ending where the assistant's answer starts."""
        return generation.chat_ids(self.backbone, prompt_or_messages, system)

    def generate(self, prompt_or_messages, max_new_tokens: int = 64, stream: bool = False,
                 system: str | None = None, do_sample: bool = False, attention=None, **gen_kwargs):
        """`Backbone.generate` (its docstring is the contract)."""
        return generation.generate(self.backbone, prompt_or_messages, max_new_tokens, stream, system, do_sample,
                                   attention, **gen_kwargs)

    def generate_many(self, prompts: list[str], max_new_tokens: int = 48, batch: int = 32) -> list[str]:
        """Greedy answers to many chat prompts, in batches (left-padded): for work that asks the model many short
        things at once, as `endo prepare --questions-by model` does."""
        return generation.generate_many(self.backbone, prompts, max_new_tokens, batch)

    def eos_ids(self) -> set[int]:
        """The ids that end generation: the model's generation config, else the tokenizer's end-of-sequence."""
        return generation.eos_ids(self.backbone)
