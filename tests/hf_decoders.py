"""Tiny Hugging Face causal language models saved as local directories, as a user's would be: real GPT-2 and Llama
classes with random weights and a byte-level tokenizer (each UTF-8 byte a token, ``<|endoftext|>`` the end)."""

from __future__ import annotations

from pathlib import Path

import torch

from pipetransformer.data.corpus import BYTE_VOCABULARY, END_OF_TEXT
from pipetransformer.export import byte_tokenizer

WIDTH = 96
LAYERS = 4
HEADS = 4
POSITIONS = 64


def decoder_config(family: str, *, tied: bool, vocabulary: int = BYTE_VOCABULARY) -> object:
    """A tiny config of ``family`` (``gpt2`` or ``llama``), its token embeddings and output projection tied or not;
    no dropout, so a pipeline's micro-batches and one process draw nothing different. A ``vocabulary`` above the
    tokenizer's pads the table with rows no input touches, as real checkpoints pad theirs."""
    from transformers import GPT2Config, LlamaConfig

    ids = {"bos_token_id": END_OF_TEXT, "eos_token_id": END_OF_TEXT, "tie_word_embeddings": tied}
    if family == "gpt2":
        return GPT2Config(vocab_size=vocabulary, n_positions=POSITIONS, n_embd=WIDTH, n_layer=LAYERS,
                          n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    return LlamaConfig(vocab_size=vocabulary, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                       max_position_embeddings=POSITIONS, **ids)


def write_decoder(directory: Path, family: str, *, tied: bool, seed: int = 0,
                  vocabulary: int = BYTE_VOCABULARY) -> Path:
    """Save a random ``family`` causal LM and the byte tokenizer to ``directory`` (returned)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(decoder_config(family, tied=tied, vocabulary=vocabulary))
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory
