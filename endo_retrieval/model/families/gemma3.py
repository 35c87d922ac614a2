"""Gemma 3 (270M to 27B): five layers in six attend through a short sliding window (512 tokens in the 270M; each
config states its own) and rotate by their own rotary embedding (base 10k); every sixth attends to the whole past
(base 1M). Queries and keys are RMS-normed per head before RoPE, and every sequence begins with <bos> (without it
the 270M's next-token loss on WikiText rises from 3.35 to 3.84 nats).

What this module tells the rest (families/__init__.py says where each is read):
- `windows` and `mask_argument`: the config's `layer_types` and `sliding_window` (the defaults read them);
- `rope_group` / `rotary`: a layer rotates by the one rotary module, asked for its layer type;
- `prefix_ids`: <bos>;
- `decoder`: a multimodal checkpoint's (4B and up, `Gemma3ForConditionalGeneration`) language model;
- `repair`: transformers 5.2 builds a GGUF file's tokenizer as a BPE without merges, which cuts every word into
  characters; it is rebuilt here from the file's vocabulary (SentencePiece BPE: merges ranked by the merged
  piece's id, control tokens special, user-defined ones whole), with Gemma's chat template and <end_of_turn> as
  an end of generation, which a base model's file does not carry.
Decode-time backends: the whole-past layers can run ReAttention (its sliding layers attend within their window,
which is the model's own attention); PrHS and retrieval-completion are refused (attention/base.py says why), as is
the streaming prefill's frame cache (one frame for all layers).
"""
from __future__ import annotations

import json
from pathlib import Path

from endo_retrieval.model.families import Family

FULL, SLIDING = "full_attention", "sliding_attention"

# Gemma's chat template, for text: a system message is prefixed to the first user turn; the assistant is "model"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
END_OF_TURN = "<end_of_turn>"
CONTROL, USER_DEFINED = 3, 4  # GGUF token types (SentencePiece's)


class Gemma3(Family):
    def decoder(self, model):
        body = model.model
        return getattr(body, "language_model", body)  # a multimodal checkpoint's text decoder

    def rope_group(self, config, layer):
        return FULL if layer is None else config.layer_types[layer]

    def rotary(self, model, layer):
        emb = self.decoder(model).rotary_emb
        kind = FULL if layer is None else emb.config.layer_types[layer]
        return (lambda x, positions: emb(x, positions, kind)), float(getattr(emb, f"{kind}_attention_scaling", 1.0))

    def prefix_ids(self, tokenizer):
        return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]

    def repair(self, folder: Path, gguf: Path) -> None:
        from tokenizers import AddedToken
        from transformers.convert_slow_tokenizer import generate_merges
        from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

        from endo_retrieval.model.gguf_header import read_gguf_header

        meta = read_gguf_header(gguf, keep=("tokenizer.",)).metadata
        tokens, kinds = meta["tokenizer.ggml.tokens"], [int(t) for t in meta["tokenizer.ggml.token_type"]]
        vocab: dict[str, int] = {}
        for i, token in enumerate(tokens):
            vocab.setdefault(token, i)
        special = lambda key, default: tokens[int(meta[key])] if key in meta else default
        tok = GemmaTokenizer(vocab=vocab, merges=generate_merges(vocab, None),
                             unk_token=special("tokenizer.ggml.unknown_token_id", "<unk>"),
                             bos_token=special("tokenizer.ggml.bos_token_id", "<bos>"),
                             eos_token=special("tokenizer.ggml.eos_token_id", "<eos>"),
                             pad_token=special("tokenizer.ggml.padding_token_id", "<pad>"))
        # SentencePiece matches control and user-defined pieces whole, before its merges; control ones are special
        tok.add_tokens([AddedToken(t, normalized=False, special=k == CONTROL)
                        for t, k in zip(tokens, kinds) if k in (CONTROL, USER_DEFINED)])
        tok.chat_template = meta.get("tokenizer.chat_template") or CHAT_TEMPLATE
        tok.save_pretrained(folder)
        generation = folder / "generation_config.json"
        config = json.loads(generation.read_text()) if generation.exists() else {}
        eos = config.get("eos_token_id", tok.eos_token_id)
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        config["eos_token_id"] = eos + [i for i in (tok.eos_token_id, vocab.get(END_OF_TURN)) if i is not None
                                        and i not in eos]
        generation.write_text(json.dumps(config, indent=2))

    def tiny_config(self, vocab_size, layers=4, head_dim=16, **overrides):
        """Gemma 3's shape, small: a 16-token window in the layers other than every third, one KV head."""
        import transformers

        settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=head_dim, query_pre_attn_scalar=head_dim,
                        max_position_embeddings=4096, sliding_window=16,
                        layer_types=[FULL if (i + 1) % 3 == 0 else SLIDING for i in range(layers)])
        return transformers.Gemma3TextConfig(**{**settings, **overrides})


FAMILY = Gemma3("gemma3", model_types=("gemma3_text", "gemma3"), gguf_architectures=("gemma3",),
                config_class="Gemma3TextConfig")
