"""Tiny offline models for dry runs and tests: a random Llama with the bundled GPT-2 vocabulary, saved as a local
transformers model directory (what the FWL GPU recipe's dry run loads; ``tests/helpers.py`` builds the same)."""

from __future__ import annotations

from pathlib import Path


def tiny_llama_dir(directory: Path, max_positions: int = 2048, n_layers: int = 2) -> Path:
    """A tiny random Llama (seed 0, the bundled GPT-2 vocabulary, tied embeddings, ``n_layers`` decoder blocks)
    saved with its tokenizer as a local model directory in ``directory`` (created)."""
    import gzip
    from importlib import resources

    import torch
    from transformers import GPT2Tokenizer, LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    assets = resources.files("fastweights") / "data" / "assets" / "gpt2"
    for name in ("vocab.json", "merges.txt"):
        (directory / name).write_bytes(gzip.decompress((assets / f"{name}.gz").read_bytes()))
    tok = GPT2Tokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=n_layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory
