"""Did a model trained on needle-in-a-haystack text learn the skill, and what does its memory return: diagnostics
of a ``niah-cpu`` checkpoint (``benchmarks/quality/niah_cpu.py``, ``niah_pilots.py``). :func:`answer_digit_accuracy`:
greedy accuracy on the answer digits of the questions in the held-out span of its own training corpus, against the
needles' own digits (chance). :func:`memory_value_probe`: with an FwPKM memory at layer 0 behind a short
convolution a question's query equals its needle's, so the value read at each question is compared (cosine) with
the needle's value target and with the other needles'."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F

DATA = "tinyshakespeare"  # the haystack: the text the preset's corpus niah-tinyshakespeare is built from


def answer_digit_accuracy(ckpt: Path, chars: int) -> dict:
    """Did the model learn the skill it was trained for? Greedy next-character accuracy on the answer
    digits of the questions in the first ``chars`` characters of the held-out (test) span of its own training
    corpus, against the same accuracy on the needles' digits, which nothing earlier predicts (chance level)."""
    from fastweights.models.loading import load_checkpoint
    from fastweights.data import load_corpus, split_corpus
    from fastweights.tasks.niah import KEY_HEX, NEEDLE_TEMPLATE, VALUE_DIGITS  # (importing registers the corpora)

    model, tok, cfg = load_checkpoint(ckpt)
    model.eval()
    docs = load_corpus(cfg.data.corpus)
    text = "".join(d.text for d in split_corpus(docs, cfg.data.split, cfg.data.val_fraction,
                                                   cfg.data.test_fraction)["test"])[:chars]
    text = text[text.index("\n\n") + 2:]  # start at a record boundary
    ids = torch.tensor(tok.encode(text))  # [N]
    if ids.numel() != len(text):
        raise SystemExit(f"error: {ckpt} does not use a character tokenizer (the answer digits need one token each)")
    preds, state = [], None
    with torch.no_grad():
        for s in range(0, ids.numel(), cfg.train.seq_len):
            out = model(ids[None, s : s + cfg.train.seq_len], state)
            state = model.trim_state(out.state, cfg.train.seq_len)
            preds.append(out.logits.argmax(-1)[0])
    hit = torch.cat(preds)[:-1] == ids[1:]  # hit[j - 1]: was character j predicted from those before it?
    needle = re.escape(NEEDLE_TEMPLATE).replace(r"\{key\}", f"(ID-[0-9a-f]{{{KEY_HEX}}})").replace(
        r"\{value\}", f"(\\d{{{VALUE_DIGITS}}})")
    hits = {"question": [0, 0], "needle": [0, 0]}
    for m in re.finditer(needle, text):  # a key's first occurrence is its needle, later ones are questions
        kind = "needle" if text.find(m.group(1)) == m.start(1) else "question"
        hits[kind][0] += int(hit[m.start(2) - 1 : m.end(2) - 1].sum())
        hits[kind][1] += m.end(2) - m.start(2)
    return {"question_answer_digits": float(hits["question"][0] / hits["question"][1]),
            "needle_digits_chance": float(hits["needle"][0] / hits["needle"][1]),
            "questions": hits["question"][1] // VALUE_DIGITS, "chars": len(text)}


@torch.no_grad()
def memory_value_probe(model, tok, chars: int = 4096, seed: int = 7, haystack: str = DATA) -> dict | None:
    """Cosines of the layer-0 FwPKM read at each question against the needles' value targets (see above)."""
    from fastweights.tasks.niah import Haystack, training_text

    block = model.blocks[0]
    if block.memory is None or block.short_conv is None:
        return None
    mem = block.memory
    text = training_text(Haystack.load(haystack), chars, seed=seed)
    ids = torch.tensor(tok.encode(text))[None]  # [1, T]
    x = model.embed(ids)
    x = x + block.short_conv(x)[0]
    q, v, _ = mem.io.inputs(block.memory_norm(x))
    q = q.view(1, ids.shape[1], mem.heads, mem.d_key)  # [1, T, H, d_k]
    v_hat, _ = mem.memory(q, v, torch.ones_like(v[..., 0]))  # [1, T, d_v]; every loss weight 1
    v_hat, v = v_hat[0], v[0]
    first, rows = {}, []
    for m in re.finditer(r"(ID-[0-9a-f]{4}) is (\d)", text):
        key, pos = m.group(1), m.start(2)  # pos: the answer's first digit
        if key not in first:
            first[key] = pos
            continue
        read = v_hat[pos - 1]  # the query before the digit reads what the needle's digit was written with
        cos = lambda j: float(F.cosine_similarity(read, v[j], dim=-1))  # noqa: E731
        others = [cos(j) for k, j in first.items() if k != key]
        rows.append({"gap": pos - first[key], "cos_target": round(cos(first[key]), 4),
                     "max_cos_other_needles": round(max(others), 4) if others else None})
    near = [r for r in rows if r["gap"] < 500 and r["max_cos_other_needles"] is not None]
    return {"chars": chars, "seed": seed, "haystack": haystack, "questions": rows,
            "gap_under_500": {"n": len(near),
                              "cos_target_range": [min(r["cos_target"] for r in near), max(r["cos_target"] for r in near)],
                              "max_cos_other_range": [min(r["max_cos_other_needles"] for r in near),
                                                      max(r["max_cos_other_needles"] for r in near)],
                              "target_beats_others": sum(r["cos_target"] > r["max_cos_other_needles"] for r in near)}
            if near else None}
