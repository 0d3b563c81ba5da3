"""Behaviour probes: the evidence that a stored result still measures the code as it is.

A result in ``benchmarks/results/`` (a benchmark script's, or a file a ``fastweights`` command wrote) records
the probes of the code path it measured, each as a spec and the summary of its outputs::

    "probes": [{"kind": "model", "args": {"config": {...}}, "summary": {"logits": "2x48x96: ...", ...}}, ...]

A probe is a seconds-long, deterministic fp64 run of exactly that code path (a model built from the
measured configuration with seeded random weights, a layer, a dynamic-evaluation rule, a scorer, a
task generator) on fixed inputs; its summary (``summaries.py`` beside this file) holds, for each
output and gradient, its norm and a few fixed projections. ``tools/evidence.py`` recomputes
every stored probe: a result whose summaries moved by more than the tolerance measured code that no longer
behaves the same, and is marked stale with the command that re-runs it. A refactor that leaves the
behaviour alone (a renamed variable, a moved function, a new import) leaves every result current; a
one-character change in an operator a result reaches only through an import moves its probe.

The repository's tools, not the ``fastweights`` package, hold the probes: the package records provenance and
writes results, and ``import fastweights`` never builds a probe. A benchmark declares its probes in
``probe_specs(probes)`` (this module is passed in, so no script imports it) and ``evidence.py`` stamps a new
result's summaries after it was written, when the code is still the code that wrote it.

Probes run in fp64 from the first weight on (the default dtype is float64 while a probe builds and runs:
an fp32 initialisation would carry the last bits of a CPU's vectorised random-number kernels, which differ
between AVX2, AVX-512 and the portable kernels), on one thread, on the CPU, under a fixed seed; every
path they reach keeps fp64 (a loss keeps fp32-or-wider logits' dtype, rotary angles of fp64 inputs are
fp64). Between the CPU kernels of one machine their outputs differ by about 1e-13 of their norm.

Kinds (``args`` are JSON, so a result names its probes completely):
    model     {"config": model config}          logits, loss and every gradient, two calls with state carried
    stream    {"config", "mode"}                the streaming scorer (``stream_eval``) on one document
    dynamic   {"config", "rule", ...}           dynamic evaluation's per-token losses ("rank": low-rank deltas)
    hf_dynamic {"rule", ...}                    the same through the Hugging Face wrapper (a tiny GPT-2)
    layer     {"role", "name", "options"}       one registered component, two calls, outputs and gradients
    ops       {"op"}                            an operator family's fast paths (delta rule, linear attention, FWL)
    task      {"name"}                          a synthetic task's generator (the data a benchmark trains on)
    assoc_model {"rule", "feature_map", ...}    the associative-retrieval model (Schlag et al. section 6.1)
    retrieval_net {"model", ...}                Ba et al.'s associative-retrieval network (fast-rnn, lstm, irnn)
    source    {"path", "texts"}                 which of the given source lines exist (mutation sites)
    corpus    {"name", "tokenizer", "chars"}    a bundled corpus as read and tokenized
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from summaries import summarise  # tools/summaries.py

PROBE_VOCAB = 96  # vocabulary of probe models (a tokenizer's size changes no code path)
PROBE_CHUNK = 8  # chunk/segment sizes above this are shrunk so the probe's few tokens cross boundaries
# option values shrunk in probes: the same code path at a size that runs in milliseconds
PROBE_CAPS = {"chunk_size": PROBE_CHUNK, "segment_len": PROBE_CHUNK, "chunk": PROBE_CHUNK, "window": PROBE_CHUNK,
              "n_subkeys": 8, "d_key": 8, "d_value": 8, "hidden": 16, "topk": 4}
PROBE_DTYPE = torch.float64  # the default dtype while a probe builds and runs its model
PROBE_DYNAMIC_LR = 5e-5  # the dynamic-evaluation probes' own learning rate: none of the library's defaults


@contextlib.contextmanager
def _deterministic(seed: int = 0):
    threads = torch.get_num_threads()
    dtype = torch.get_default_dtype()
    rng = torch.get_rng_state()
    torch.set_num_threads(1)
    torch.set_default_dtype(PROBE_DTYPE)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_rng_state(rng)


def _tokens(n: int, seed: int, batch: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (n,) if batch is None else (batch, n)
    return torch.randint(0, PROBE_VOCAB, shape, generator=g)


# ----------------------------------------------------------------------------- models


def probe_config(config: dict):
    """The ModelConfig a probe builds: the measured one, with the probe vocabulary, no dropout, and
    chunk/segment/window sizes above PROBE_CHUNK shrunk to it (the same code path, reached in few tokens)."""
    from fastweights.core.config import ModelConfig, from_dict

    cfg = json.loads(json.dumps(config))  # a private copy
    cfg["vocab_size"] = PROBE_VOCAB
    cfg["dropout"] = 0.0
    from fastweights import components

    model = from_dict(ModelConfig, cfg, prefix="model")
    used = {("mixer", model.mixer_of(i)) for i in range(model.n_layers)}
    if model.head != "linear":  # the plain unembedding is no registered component
        used.add(("head", model.head))
    if model.memory:
        used.add(("memory", model.memory))
    options = dict(cfg.get("options") or {})
    for role, name in used:
        table = {"mixer": components.MIXERS, "memory": components.MEMORIES, "head": components.HEADS}[role]
        options[name] = capped_options(components.lookup(table, role, name), options.get(name))
    cfg["options"] = {k: v for k, v in options.items() if v is not None}
    return from_dict(ModelConfig, cfg, prefix="model")


def capped_options(entry, options: dict | None) -> dict | None:
    """A component's ``options`` with every size in PROBE_CAPS (given or default) capped."""
    if entry.options_cls is None:
        return options
    out = dict(options or {})
    defaults = dataclasses.asdict(entry.options_cls())
    for key, cap in PROBE_CAPS.items():
        value = out.get(key, defaults.get(key))
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            out[key] = cap
    return out


def probe_model_of(config: dict) -> torch.nn.Module:
    from fastweights.models.lm import LanguageModel

    return LanguageModel(probe_config(config)).double()


def _model(config: dict, tokens: int = 24) -> dict:
    model = probe_model_of(config).train()
    x = _tokens(2 * tokens + 1, 1, batch=2)
    inp, tgt = x[:, :-1], x[:, 1:]
    out1 = model(inp[:, :tokens])
    out2 = model(inp[:, tokens:], state=out1.state)
    logits = torch.cat([out1.logits, out2.logits], 1)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    full = model(inp, targets=tgt)  # the training forward (its loss includes any auxiliary loss)
    total = loss + full.loss
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(total, [p for _, p in params], allow_unused=True)
    result = {"logits": logits, "loss": full.loss, "full_logits": full.logits}
    for (name, _), g in zip(params, grads):
        result[f"grad.{name}"] = torch.zeros(()) if g is None else g
    return result


def _stream(config: dict, mode: str = "carry", seq_len: int = 16) -> dict:
    from fastweights.experiments.streaming import stream_eval

    model = probe_model_of(config).eval()
    doc = _tokens(70, 2).numpy()
    with torch.no_grad():
        res = stream_eval(model, [("probe", iter([doc[:40], doc[40:]]))], mode=mode, seq_len=seq_len, bin_width=8)
    losses = [d["loss"] for d in res.documents]
    return {"nll": torch.tensor(res.nll, dtype=torch.float64), "tokens": res.tokens,
            "document_losses": torch.tensor(losses, dtype=torch.float64)}


def _dynamic(config: dict | None, rule: str, lr: float = PROBE_DYNAMIC_LR, segment_len: int = 5,
             rank: int | None = None, **kw) -> dict:
    """``rank``: low-rank dynamic evaluation (``adapt.lowrank``: rank-r deltas of the MLP projections)."""
    from fastweights.adapt.dynamic import DynamicEvaluator
    from fastweights.adapt.lowrank import LowRankDynamicEvaluator, collect_lowrank_grad_stats
    from fastweights.adapt.grad_stats import collect_grad_stats
    from fastweights.adapt.update_rules import rule_needs_stats

    model = probe_model_of(config).eval() if config is not None else _tiny_gpt2()
    settings = {**kw, "lr": lr}
    lowrank = {} if rank is None else {"rank": rank}
    if rule_needs_stats(rule):
        collect = collect_lowrank_grad_stats if lowrank else collect_grad_stats
        settings["grad_stats"] = collect(model, _tokens(200, 3), batch_size=4, seq_len=segment_len, max_batches=3,
                                         **lowrank)
    evaluator = LowRankDynamicEvaluator if lowrank else DynamicEvaluator
    ev = evaluator(model, rule=rule, segment_len=segment_len, **settings, **lowrank)
    tokens = _tokens(41, 4)
    first, state = ev.evaluate(tokens[:23], final=False)
    second, _ = ev.evaluate(tokens[23:], state=state)
    static = ev.static(tokens)
    return {"dynamic": torch.tensor(first.token_losses + second.token_losses, dtype=torch.float64),
            "static": torch.tensor(static.token_losses, dtype=torch.float64)}


def _tiny_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    from fastweights.hf.transformers_as_ours import HFCausalLM

    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=PROBE_VOCAB, n_positions=64, bos_token_id=0,
                     eos_token_id=0)
    return HFCausalLM(GPT2LMHeadModel(cfg).double().eval())


def _hf_dynamic(rule: str, **kw) -> dict:
    return _dynamic(None, rule, **kw)


def _hf_fwl(variant: str = "fwl") -> dict:
    """An FWL head on a tiny GPT-2 (``fastweights.hf.fwl_head``): streamed logits in two calls, one training
    step's loss and gradients from hidden states (``fastweights.hf.fwl_training``)."""
    import dataclasses

    from fastweights.hf.fwl_head import PRETRAINED_FWL_DEFAULTS, HFCausalLMWithFWL
    from fastweights.hf.fwl_training import VARIANTS, window_loss
    from fastweights.layers.fwl import FWLOptions

    opts = FWLOptions(**{**PRETRAINED_FWL_DEFAULTS, "segment_len": 8, "chunk_size": 16, **VARIANTS[variant]})
    model = HFCausalLMWithFWL(_tiny_gpt2(), dataclasses.replace(opts, step_size_init=0.05)).double()
    with torch.no_grad():
        model.head.ln_weight.fill_(0.5)  # a trained gain: the branch and every fast tensor act
    model.eval()
    tokens = _tokens(41, 5)[None]
    with torch.no_grad():
        first = model(tokens[:, :23])
        second = model(tokens[:, 23:], state=first.state)
        h, _ = model.backbone.forward_features(tokens)
    model.train()
    out = {"logits": torch.cat([first.logits, second.logits], 1)}
    return _with_grads(model.head, window_loss(model.head, h, tokens), out)


# ----------------------------------------------------------------------------- layers and operators


def _layer(role: str, name: str, options: dict | None = None, d_model: int = 16) -> dict:
    from fastweights import components

    table = {"mixer": components.MIXERS, "memory": components.MEMORIES, "head": components.HEADS}[role]
    entry = components.lookup(table, role, name)
    opts = components.build_options(entry, capped_options(entry, options))
    kwargs = {"d_model": d_model, **({"n_heads": 2} if role == "mixer" else {})}  # as LanguageModel builds them
    layer = (entry.cls(**kwargs, options=opts) if opts is not None else entry.cls(**kwargs)).double().train()
    x = torch.randn(2, 22, d_model, dtype=torch.float64, requires_grad=True)
    y1, state = layer(x[:, :13])
    y2, _ = layer(x[:, 13:], state)
    y = torch.cat([y1, y2], 1)
    w = torch.randn_like(y)
    params = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad((y * w).sum() + (y ** 2).sum(), [x] + [p for _, p in params], allow_unused=True)
    out = {"y": y, "grad_x": grads[0]}
    for (n, _), g in zip(params, grads[1:]):
        out[f"grad.{n}"] = torch.zeros(()) if g is None else g
    return out


def _ops(op: str) -> dict:
    import importlib

    dr = importlib.import_module("fastweights.ops.delta_rule")
    la = importlib.import_module("fastweights.ops.linear_attention")

    b, h, t, d = 2, 2, 21, 8
    q, k, v = (torch.randn(b, h, t, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    beta = torch.rand(b, h, t, dtype=torch.float64, requires_grad=True)
    log_decay = -torch.rand(b, h, t, dtype=torch.float64)
    kn = torch.nn.functional.normalize(k, dim=-1)
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "delta_rule": lambda: dr.delta_rule(q, kn, v, beta, chunk_size=8, backend="torch", output_final_state=True),
        "gated_delta_rule": lambda: dr.delta_rule(q, kn, v, beta, log_decay=log_decay, chunk_size=8, backend="torch",
                                                  output_final_state=True),
        "linear_attention": lambda: la.linear_attention(q, k.abs(), v, chunk_size=8, output_final_state=True,
                                                        normalize=True),
        "gated_rule": lambda: la.gated_rule(q, k.abs(), v, beta, chunk_size=8, output_final_state=True),
    }
    if op not in runs:
        raise ValueError(f"unknown ops probe {op!r}; known: {sorted(runs)}")
    y, final = runs[op]()
    loss = (y ** 2).sum() + (final ** 2).sum()
    grads = torch.autograd.grad(loss, [q, k, v, beta], allow_unused=True)
    out = {"y": y, "final": final}
    for name, g in zip("qkvb", grads):
        out[f"grad_{name}"] = torch.zeros(()) if g is None else g
    return out


# ----------------------------------------------------------------------------- tasks, sources, corpora


def _task(name: str) -> dict:
    if name == "assoc":
        from fastweights.tasks.assoc import AssocData

        data = AssocData(20, 2, np.random.default_rng(0))
        return {k: v for k, v in vars(data).items() if isinstance(v, (np.ndarray, torch.Tensor, int, list))}
    if name == "ba_retrieval":
        from fastweights.tasks.ba_retrieval import generate

        x, y = generate(16, 8, np.random.default_rng(0))
        return {"x": x, "y": y}
    if name == "niah_multitoken":
        from fastweights.tasks.niah import score_answer
        from fastweights.tasks.niah_multitoken import make_sample
        from fastweights.tasks.niah_token import WordHaystack

        hay = WordHaystack("it was the best of times , it was the worst of times .".split() * 100, "probe")
        sample = make_sample(hay, 300, depth=0.5, seed=3)
        got = score_answer(" " + sample.answer.split(" ")[0] + " <d00> and", sample)
        return {**{k: v for k, v in vars(sample).items() if isinstance(v, (str, int, float, list))},
                "score": [got["exact"], got["per_token"], got["candidate"]]}
    if name in ("niah", "niah_token"):
        from fastweights.data.tokenizers import ByteTokenizer
        from fastweights.tasks.niah import Haystack, make_sample

        text = "It was the best of times, it was the worst of times. " * 40
        tok = ByteTokenizer()
        sample = make_sample(Haystack(text, "probe"), tok, 300, depth=0.5, seed=3)
        return {k: v for k, v in vars(sample).items() if isinstance(v, (str, int, float, list))}
    raise ValueError(f"unknown task probe {name!r}")


def _source(path: str, texts: list[str]) -> dict:
    from fastweights.evidence.provenance import package_checkout

    root = package_checkout() or Path.cwd()
    file = root / path
    content = file.read_text() if file.exists() else ""
    return {"present": [t in content for t in texts]}


def _corpus(name: str, tokenizer: str = "char", chars: int = 4000) -> dict:
    from fastweights.data import load_corpus
    from fastweights.data.corpus import text_pieces
    from fastweights.data.tokenizers import build_tokenizer

    docs = load_corpus(name)
    text = ""
    for piece in text_pieces(docs[:1]):
        text += piece
        if len(text) >= chars:
            break
    text = text[:chars]
    return {"documents": len(docs), "text": text, "ids": build_tokenizer(tokenizer, text).encode(text)}


def _with_grads(module: torch.nn.Module, loss: torch.Tensor, out: dict) -> dict:
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    for (n, _), g in zip(params, grads):
        out[f"grad.{n}"] = torch.zeros(()) if g is None else g
    return out


def _assoc_model(rule: str, feature_map: str, nu: int = 1, setting: int = 1, n_keys: int = 12, **kw) -> dict:
    from fastweights.tasks.assoc import AssocData, AssocModel, retrieval_loss

    model = AssocModel(n_keys, rule=rule, feature_map=feature_map, nu=nu, **kw).double()
    keys, values, queries, targets = AssocData(n_keys, setting, np.random.default_rng(0)).batch(3)
    y = model(keys, values, queries)
    loss = retrieval_loss(y, targets).mean()
    return _with_grads(model, loss, {"y": y, "loss": loss})


def _retrieval_net(model: str, hidden: int = 12, fast_rnn: dict | None = None) -> dict:
    from fastweights.tasks.ba_retrieval import RetrievalNet, generate

    net = RetrievalNet(model, hidden, embed=10, mlp=10, fast_rnn=fast_rnn).double()
    x, y = generate(4, 4, np.random.default_rng(0))
    logits = net(torch.as_tensor(x))
    loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(y).long().reshape(-1))
    return _with_grads(net, loss, {"logits": logits, "loss": loss})


KINDS: dict[str, Callable[..., dict]] = {
    "assoc_model": _assoc_model, "retrieval_net": _retrieval_net, "model": _model, "stream": _stream, "dynamic": _dynamic, "hf_dynamic": _hf_dynamic, "hf_fwl": _hf_fwl, "layer": _layer,
    "ops": _ops, "task": _task, "source": _source, "corpus": _corpus,
}


# ----------------------------------------------------------------------------- the public functions


def probe(kind: str, **args) -> dict:
    """A probe spec (JSON): ``probe("model", config=cfg)``."""
    if kind not in KINDS:
        raise ValueError(f"unknown probe kind {kind!r}; known: {sorted(KINDS)}")
    return {"kind": kind, "args": json.loads(json.dumps(args))}


def run_probe(spec: dict) -> dict[str, str]:
    """The summary of ``spec`` ({"kind", "args"}) under the code as it is now
    (:func:`summaries.summarise` of its outputs)."""
    kind = spec["kind"]
    if kind not in KINDS:
        raise ValueError(f"unknown probe kind {kind!r}; known: {sorted(KINDS)}")
    with _deterministic():
        return summarise(KINDS[kind](**spec.get("args", {})))


def summarised(specs: list[dict]) -> list[dict]:
    """``specs`` with their summaries, as a result records them (a spec named twice runs once; one that
    already carries a summary, measured earlier, keeps it)."""
    out, seen = [], {}
    for spec in specs:
        if "summary" in spec:
            out.append(spec)
            continue
        key = json.dumps(spec, sort_keys=True)
        if key not in seen:
            seen[key] = run_probe(spec)
            out.append({**spec, "summary": seen[key]})
    return out


def model_probes(config: dict, stream_modes: tuple[str, ...] = ()) -> list[dict]:
    """The probes of a model configuration: the model itself, and the streaming scorer in ``stream_modes``."""
    return [probe("model", config=config)] + [probe("stream", config=config, mode=m) for m in stream_modes]


def preset_model_config(preset: str, overrides: list[str] | None = None) -> dict:
    """The model section of a preset (with ``--set``-style overrides) as a plain dict."""
    from fastweights.core.config import make_config

    return dataclasses.asdict(make_config(preset, list(overrides or [])).model)


def preset_probes(preset: str | None, overrides: list[str] | tuple = (), stream_modes: tuple[str, ...] = ()) -> list[dict]:
    """:func:`model_probes` of a preset (None: the defaults) with ``--set``-style overrides."""
    return model_probes(preset_model_config(preset, list(overrides)), stream_modes)


def registry_probes() -> list[dict]:
    """A layer probe of every registered mixer and memory with its default options."""
    from fastweights import components

    components.load_providers()
    return ([probe("layer", role="mixer", name=n) for n in sorted(components.MIXERS)]
            + [probe("layer", role="memory", name=n) for n in sorted(components.MEMORIES)])


def checkpoint_probes(config: dict, stream_modes: tuple[str, ...] = (), dynamic_rule: str | None = None) -> list[dict]:
    """The probes of a trained run's model (its ``config.json``'s model section), for results the
    ``fastweights`` command writes about a checkpoint."""
    specs = model_probes(config, stream_modes)
    if dynamic_rule:
        specs.append(probe("dynamic", config=config, rule=dynamic_rule))
    return specs
