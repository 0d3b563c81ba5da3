"""What the online FWL-head trainer (``hf.fwl_training.train_head_online``) reads and is measured against: endless
streams of consecutive stretches of the training mix's documents (:func:`training_streams`), and the pretrained
model alone scored as the head scores, its logits in fp32 (:class:`PretrainedLogits`). The GPU recipe
``benchmarks/gpu/fwl_smollm2_gpu.py`` trains on the one and reports its gains against the other."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

from fastweights.core.errors import UserError
from fastweights.hf.fwl_training import TRAINING_MIX, held_out, round_robin
from fastweights.models.lm import ModelOutput
from fastweights.ops.linear_attention import no_autocast


def training_streams(tok, length: int, seed: int, streams_per_doc: int = 0, corpora=TRAINING_MIX):
    """Endless iterator of ``(ids [length] int64, source)``: consecutive, non-overlapping stretches of ``length``
    tokens of each document (at most ``streams_per_doc``, 0 = all), the corpora in turn, the documents of each
    in a seeded order that is drawn again every pass. Documents are tokenized when first reached."""
    from fastweights.data import load_corpus

    docs = {c: [d for d in load_corpus(c) if not held_out(d.name)] for c in corpora}
    rng, encoded = random.Random(seed), {}  # the token ids of each document, kept for the next pass

    def of_corpus(corpus: str, order: list):
        for d in order:
            if (corpus, d.name) not in encoded:
                text = d.text if not streams_per_doc else d.text[: streams_per_doc * length * 8]  # >= 1 char a token
                encoded[corpus, d.name] = torch.as_tensor(tok.encode(text), dtype=torch.long)
            ids = encoded[corpus, d.name]
            n = len(ids) // length if not streams_per_doc else min(streams_per_doc, len(ids) // length)
            for i in range(n):
                yield ids[i * length:(i + 1) * length], f"{corpus}:{d.name}"

    while True:
        streams, given = [], 0
        for c in corpora:
            order = list(docs[c])
            rng.shuffle(order)
            streams.append(of_corpus(c, order))
        for item in round_robin(streams):
            given += 1
            yield item
        if not given:
            raise UserError(f"no document of {', '.join(corpora)} holds {length} tokens")


class PretrainedLogits(nn.Module):
    """The pretrained model alone, scored as the head scores: the backbone's final hidden state times its output
    layer in fp32 (under autocast the model's own output layer would run in bf16). Same state as the backbone."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.default_context = backbone.default_context

    def forward(self, tokens: torch.Tensor, state: dict | None = None, targets=None) -> ModelOutput:
        h, new_state = self.backbone.forward_features(tokens, state)
        out = self.backbone.hf.get_output_embeddings()
        with no_autocast(h.device):
            logits = F.linear(h.float(), out.weight.float(), None if out.bias is None else out.bias.float())
        return ModelOutput(logits, None, new_state)

    def trim_state(self, state: dict, keep: int) -> dict:
        return self.backbone.trim_state(state, keep)
