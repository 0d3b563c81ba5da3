"""Where does one model beat another? Per-token NLL improvement by position, token frequency and repeats.

    fastweights inspect compare --base runs/base --model runs/fwl [--data FILE] [--out runs/analysis]

Both checkpoints score the same documents token by token (streaming, state carried, as ``fastweights
eval``). For each predicted token the improvement is ``NLL_base - NLL_model`` (positive = the model is
better), averaged in buckets of

- **position** in the document (the index of the predicted token, power-of-two buckets [1, 2), [2, 4), ...);
- **frequency** of the token in the training split of the base checkpoint's corpus (decades: unseen,
  [1, 10), [10, 100), ...), or of the scored text with ``--freq-from eval``;
- **prior occurrences**: how often the same token already appeared earlier in the document (0, 1,
  [2, 4), [4, 8), ...).

This is the analysis of Clark et al. 2022 ("Meta-Learning Fast Weight Language Models", Figure 2): FWL
gains grow with position, are larger on rare tokens, and come from tokens seen before (a token's
first occurrence is slightly worse). Writes ``analysis.json`` and ``analysis.png`` into ``--out``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from fastweights.core.errors import UserError

LN2 = math.log(2)


# ----------------------------------------------------------------------------- per-token features


def prior_counts(ids: np.ndarray) -> np.ndarray:
    """For each position i, how many times ``ids[i]`` occurred in ``ids[:i]``. ``[N] -> [N]`` int64."""
    seen: dict[int, int] = {}
    out = np.empty(len(ids), dtype=np.int64)
    for i, t in enumerate(ids.tolist()):
        out[i] = seen.get(t, 0)
        seen[t] = out[i] + 1
    return out


def pow2_bucket(x: np.ndarray) -> np.ndarray:
    """0 -> 0; [1, 2) -> 1; [2, 4) -> 2; [4, 8) -> 3; ... (x >= 0 integers)."""
    x = np.asarray(x, dtype=np.int64)
    out = np.zeros(x.shape, dtype=np.int64)
    pos = x > 0
    out[pos] = np.floor(np.log2(x[pos])).astype(np.int64) + 1
    return out


def pow10_bucket(x: np.ndarray) -> np.ndarray:
    """0 -> 0; [1, 10) -> 1; [10, 100) -> 2; ... (x >= 0 integers)."""
    x = np.asarray(x, dtype=np.int64)
    out = np.zeros(x.shape, dtype=np.int64)
    pos = x > 0
    out[pos] = np.floor(np.log10(x[pos]) + 1e-12).astype(np.int64) + 1
    return out


def _pow2_label(b: int) -> str:
    return "0" if b == 0 else ("1" if b == 1 else f"{2 ** (b - 1)}-{2 ** b - 1}")


def _pow10_label(b: int) -> str:
    return "0" if b == 0 else f"{10 ** (b - 1)}-{10 ** b - 1}"


def bucket_table(keys: np.ndarray, base_nll: np.ndarray, model_nll: np.ndarray, label) -> list[dict]:
    """Mean NLLs (bits) and improvement per bucket key, in increasing key order."""
    rows = []
    total = len(keys)
    for k in np.unique(keys):
        m = keys == k
        b, f = base_nll[m].mean() / LN2, model_nll[m].mean() / LN2
        rows.append({"bucket": label(int(k)), "tokens": int(m.sum()), "share": float(m.sum() / total),
                     "base_bits": float(b), "model_bits": float(f), "improvement_bits": float(b - f)})
    return rows


def nll_improvement(base_nll: np.ndarray, model_nll: np.ndarray, positions: np.ndarray, freqs: np.ndarray,
                    priors: np.ndarray) -> dict:
    """Bucketed comparison of two per-token NLL arrays (nats) with their per-token features.

    Args:
        base_nll, model_nll: ``[N]`` NLL of each predicted token under the base and the model.
        positions: ``[N]`` index of the predicted token in its document (>= 1).
        freqs: ``[N]`` frequency of the token (training counts).
        priors: ``[N]`` earlier occurrences of the token in its document.
    """
    if len(base_nll) == 0:
        raise UserError("nothing to analyse: the documents have fewer than two tokens")
    overall = {"tokens": int(len(base_nll)), "base_bits": float(base_nll.mean() / LN2),
               "model_bits": float(model_nll.mean() / LN2),
               "improvement_bits": float((base_nll.mean() - model_nll.mean()) / LN2),
               "repeat_share": float((priors > 0).mean())}
    return {
        "overall": overall,
        "by_position": bucket_table(pow2_bucket(positions), base_nll, model_nll, _pow2_label),
        "by_frequency": bucket_table(pow10_bucket(freqs), base_nll, model_nll, _pow10_label),
        "by_prior_count": bucket_table(pow2_bucket(priors), base_nll, model_nll, _pow2_label),
    }


# ----------------------------------------------------------------------------- scoring


def score_documents(model, docs: list[torch.Tensor], seq_len: int, stride: int | None, progress=None) -> np.ndarray:
    """Per-token NLL (nats) of every predicted token of every document, concatenated (``[sum(len - 1)]``)."""
    from fastweights.loops.evaluate import score_tokens

    out = []
    for ids in docs:
        if len(ids) < 2:
            continue
        r, _ = score_tokens(model, ids, seq_len, stride, keep_token_losses=True, progress=progress)
        out.append(np.asarray(r.token_losses, dtype=np.float64))
    return np.concatenate(out) if out else np.zeros(0)


def features(docs: list[torch.Tensor], counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, frequencies, prior counts) of every predicted token, aligned with :func:`score_documents`."""
    pos, freq, prior = [], [], []
    for ids in docs:
        if len(ids) < 2:
            continue
        a = ids.numpy()
        pos.append(np.arange(1, len(a)))
        freq.append(counts[a[1:]])
        prior.append(prior_counts(a)[1:])
    if not pos:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(pos), np.concatenate(freq), np.concatenate(prior)


def token_counts(tokenizer, texts, vocab_size: int) -> np.ndarray:
    """``[V]`` occurrence counts of each token id in ``texts``."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for t in texts:
        ids = np.asarray(tokenizer.encode(t), dtype=np.int64)
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def plot_analysis(result: dict, path: Path) -> None:
    """Three bar charts of the mean improvement (bits) per bucket, token counts above the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastweights.core.files import save_figure

    panels = [("by_position", "position in document"), ("by_frequency", "training frequency of the token"),
              ("by_prior_count", "earlier occurrences in the document")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, xlabel) in zip(axes, panels):
        rows = result[key]
        xs = np.arange(len(rows))
        vals = [r["improvement_bits"] for r in rows]
        ax.bar(xs, vals, color=["tab:green" if v >= 0 else "tab:red" for v in vals])
        ax.axhline(0, color="black", lw=0.8)
        ax.set_xticks(xs, [r["bucket"] for r in rows], rotation=45, ha="right", fontsize=8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("NLL improvement (bits / token)")
        for x, r in zip(xs, rows):
            ax.annotate(f"{r['tokens']}", (x, r["improvement_bits"]), ha="center", fontsize=6,
                        xytext=(0, 2 if r["improvement_bits"] >= 0 else -8), textcoords="offset points")
        ax.grid(alpha=0.3, axis="y")
    o = result["overall"]
    fig.suptitle(f"{result['model']} vs {result['base']}: {o['improvement_bits']:+.4f} bits/token over "
                 f"{o['tokens']} tokens", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def analyze(base_dir: Path, model_dir: Path, data: str | None = None, split: str = "test", seq_len: int = 0,
            stride: int | None = None, max_chars: int = 0, freq_from: str = "train", device: str = "cpu",
            progress: bool = True) -> dict:
    """Load two checkpoints, score the same text with both and bucket the per-token NLL improvement."""
    from fastweights.models.loading import load_checkpoint
    from fastweights.data import first_chars, load_corpus, split_corpus
    from fastweights.core.progress import Progress

    if freq_from not in ("train", "eval"):
        raise UserError(f"--freq-from must be train or eval, got {freq_from!r}")
    base, base_tok, base_cfg = load_checkpoint(Path(base_dir), map_location=device)
    model, tok, cfg = load_checkpoint(Path(model_dir), map_location=device)
    if base_tok.fingerprint() != tok.fingerprint():
        raise UserError(f"the checkpoints use different tokenizers ({base_tok.fingerprint()} vs {tok.fingerprint()}); "
                        "per-token comparison needs the same one")
    if data:
        texts = [d.text for d in load_corpus(data, text_field=cfg.data.text_field)]
        where = data
    else:
        docs = load_corpus(cfg.data.corpus, text_field=cfg.data.text_field)
        texts = [d.text for d in split_corpus(docs, cfg.data.split, cfg.data.val_fraction, cfg.data.test_fraction)[split]]
        where = f"{cfg.data.corpus}:{split}"
    texts = first_chars(texts, max_chars)
    encoded = [torch.as_tensor(np.asarray(tok.encode(t), dtype=np.int64)) for t in texts]
    vocab = cfg.model.vocab_size
    if freq_from == "train":
        docs = load_corpus(base_cfg.data.corpus, text_field=base_cfg.data.text_field)
        train_docs = split_corpus(docs, base_cfg.data.split, base_cfg.data.val_fraction, base_cfg.data.test_fraction)["train"]
        counts = token_counts(tok, (d.text for d in train_docs), vocab)
    else:
        counts = token_counts(tok, texts, vocab)
    seq_len = seq_len or cfg.train.seq_len
    if stride is not None and not 0 < stride <= seq_len:
        raise UserError(f"--stride must be in [1, seq_len = {seq_len}], got {stride}")
    n = sum(max(0, len(e) - 1) for e in encoded)
    bar = Progress(2 * n, "tok", desc="compare", enabled=progress)
    base_nll = score_documents(base, encoded, seq_len, stride, bar)
    model_nll = score_documents(model, encoded, seq_len, stride, bar)
    bar.close()
    positions, freqs, priors = features(encoded, counts)
    result = {"base": str(base_dir), "model": str(model_dir), "data": where, "seq_len": seq_len,
              "stride": stride or max(1, seq_len // 2), "frequency_from": freq_from}
    result.update(nll_improvement(base_nll, model_nll, positions, freqs, priors))
    return result
