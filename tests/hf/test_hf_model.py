"""fastweights models as Hugging Face causal LMs: config and weights round-trip for every registered
mixer, head and memory; generate() with the fast-weight state as cache equals fastweights'
greedy generation; export-hf gives a directory that AutoModelForCausalLM / AutoTokenizer load."""

import copy
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from fastweights.checkpoints.format import save_model  # noqa: E402
from fastweights.core.config import ModelConfig, RunConfig  # noqa: E402
from fastweights.core.errors import UserError  # noqa: E402
from fastweights.data.tokenizers import build_tokenizer  # noqa: E402
from fastweights.loops.generate import generate_tokens  # noqa: E402
from fastweights import components as registry  # noqa: E402
from fastweights.hf.ours_as_transformers import FastWeightsCache, FastWeightsConfig, FastWeightsForCausalLM  # noqa: E402
import fastweights.hf.ours_as_transformers as hf_module  # noqa: E402
from fastweights.models.lm import LanguageModel  # noqa: E402
from helpers import HANG_GUARD_S, component_fields

VOCAB = 13
MAX_ELEMENTS = 100_000  # parameters + buffers of one test model
# every registered component (kind, name); each is built with the tiny options it declares (its defaults
# are the papers' sizes), and test_components_are_tiny says when those are too large to test
COMPONENTS = [(kind, e.name) for kind, e in registry.registered()]


def tiny_options(kind: str, name: str) -> dict:
    """The options ``name`` declares for a small test model (``tiny_options`` on its class)."""
    return dict(registry.declared(registry.lookup(registry.KINDS[kind], kind, name), "tiny_options"))


def tiny_config(kind: str, name: str, **overrides) -> ModelConfig:
    fields = component_fields(kind, name)
    options = {name: tiny_options(kind, name)} if tiny_options(kind, name) else {}
    # init_std 0.3: logits far from uniform, so greedy decoding does not repeat one token
    base = dict(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, init_std=0.3, options=options)
    return ModelConfig(**{**base, **fields, **overrides})


def tiny_model(kind: str, name: str, seed: int = 0, **overrides) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(tiny_config(kind, name, **overrides)).eval()


@pytest.mark.parametrize("kind,name", COMPONENTS)
def test_components_are_tiny(kind, name):
    lm = tiny_model(kind, name)
    n = sum(p.numel() for p in lm.parameters()) + sum(b.numel() for b in lm.buffers())
    assert n <= MAX_ELEMENTS, f"{kind} {name!r} has {n} elements at tiny dims: declare tiny_options on its class"


def test_config_round_trip(tmp_path):
    mc = ModelConfig(vocab_size=VOCAB, d_model=24, n_layers=3, n_heads=3, layer_mixers=["attention", "fwp", "gdn"],
                     memory="fwpkm", memory_layers=[1], head="fwl", tie_embeddings=False, dropout=0.1,
                     options={"fwp": {"rule": "sum", "feature_map": "elu1"}, "fwpkm": {"n_subkeys": 4}})
    cfg = FastWeightsConfig.from_model_config(mc, eos_token_id=3)
    assert cfg.to_model_config() == mc
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (24, 3, 3)
    cfg.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, FastWeightsConfig)
    assert loaded.to_model_config() == mc and loaded.eos_token_id == 3
    # the defaults are ModelConfig's
    assert FastWeightsConfig().to_model_config() == ModelConfig()


@pytest.mark.parametrize("kind,name", COMPONENTS)
def test_save_load_identical_logits_and_cache(kind, name, tmp_path):
    lm = tiny_model(kind, name)
    hf = FastWeightsForCausalLM.from_language_model(lm)
    x = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = lm(x).logits
        assert torch.equal(hf(x).logits, ref)
        hf.save_pretrained(tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert type(loaded) is FastWeightsForCausalLM
        assert loaded.model.config == lm.config
        out = loaded(x)
        assert torch.equal(out.logits, ref)
        # the returned cache continues the sequence: pieces == one call (chunked vs stepwise paths: close)
        first = loaded(x[:, :6])
        assert isinstance(first.past_key_values, FastWeightsCache)
        assert first.past_key_values.get_seq_length() == 6
        second = loaded(x[:, 6:], past_key_values=first.past_key_values)
        assert second.past_key_values.get_seq_length() == 10
        torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,name", COMPONENTS)
def test_greedy_generate_equals_generate_tokens(kind, name):
    lm = tiny_model(kind, name, seed=2)
    hf = FastWeightsForCausalLM.from_language_model(lm)
    prompt = [1, 5, 2, 7, 7, 3]
    ours = list(generate_tokens(lm, prompt, 12, temperature=0))
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                      output_logits=True)
    assert out.sequences[0, :len(prompt)].tolist() == prompt
    assert out.sequences[0, len(prompt):].tolist() == ours
    # every step's logits are those of the model reading prompt, then one token at a time with its state
    # (a greedy sequence alone can repeat one token whatever the state)
    with torch.no_grad():
        step = lm(torch.tensor([prompt]))
        expected = [step.logits[0, -1]]
        for t in ours[:-1]:
            step = lm(torch.tensor([[t]]), step.state)
            expected.append(step.logits[0, -1])
    assert torch.equal(torch.stack([s[0] for s in out.logits]), torch.stack(expected))


def test_generate_continues_from_returned_cache():
    lm = tiny_model("mixer", "fwp", seed=3, n_layers=2, layer_mixers=["fwp", "attention"])
    hf = FastWeightsForCausalLM.from_language_model(lm)
    prompt = torch.tensor([[4, 1, 9, 2]])
    whole = hf.generate(prompt, max_new_tokens=10, do_sample=False)
    first = hf.generate(prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = first.past_key_values
    assert isinstance(cache, FastWeightsCache) and cache.get_seq_length() == 4 + 3  # last token not read yet
    # the cache argument's name: "cache" from transformers 5.24 on ("past_key_values" before)
    rest = hf.generate(first.sequences, **{hf_module._CACHE_FIELD: cache}, max_new_tokens=6, do_sample=False)
    assert torch.equal(rest, whole)


def test_batched_sampling_runs_and_respects_prompt():
    lm = tiny_model("mixer", "gdn", seed=4)
    hf = FastWeightsForCausalLM.from_language_model(lm)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    torch.manual_seed(0)
    out = hf.generate(prompt, max_new_tokens=5, do_sample=True, top_k=4, num_return_sequences=2)
    assert out.shape == (4, 8)
    assert torch.equal(out[:, :3], prompt.repeat_interleave(2, 0))


def test_beam_search_reorders_state():
    # reference: beam search that recomputes the whole prefix at every step (no cache)
    # every kind of per-sequence state: fast weight matrix, KV cache, FWL head, FwMLP writing every 4 tokens
    fwmlp = {**tiny_options("memory", "fwmlp"), "persistence": "per_sequence"}
    lm = tiny_model("mixer", "fwp", seed=5, n_layers=2, layer_mixers=["fwp", "attention"], head="fwl",
                    memory="fwmlp", memory_layers=[1], options={"fwl": tiny_options("head", "fwl"), "fwmlp": fwmlp})
    hf = FastWeightsForCausalLM.from_language_model(lm)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    kw = dict(max_new_tokens=6, num_beams=3, do_sample=False, num_return_sequences=3)
    cached = hf.generate(prompt, **kw)
    recomputed = hf.generate(prompt, use_cache=False, **kw)
    assert torch.equal(cached, recomputed)


def test_beam_search_refuses_shared_memory():
    lm = tiny_model("memory", "fwpkm", seed=6)  # persistence "stream": one memory for the batch
    hf = FastWeightsForCausalLM.from_language_model(lm)
    with pytest.raises(ValueError, match="shared across the batch"):
        hf.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=3, num_beams=2, do_sample=False)


def test_forward_loss_padding_and_cache_checks():
    lm = tiny_model("memory", "fwmlp", seed=7)
    hf = FastWeightsForCausalLM.from_language_model(lm)
    x = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    labels = x.clone()
    labels[0, 4] = -100
    out = hf(x, labels=labels, use_cache=False)
    assert out.past_key_values is None
    ref = lm(x[:, :-1], targets=labels[:, 1:])
    expected = ref.loss if ref.aux_loss is None else ref.loss + ref.aux_loss
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()  # trainable through the HF interface
    assert hf.model.embed.weight.grad is not None
    assert hf(x, logits_to_keep=1).logits.shape == (2, 1, VOCAB)
    # padding (tests/contracts/test_padding.py): this memory is shared by the batch, so rows padded differently
    # are refused; a mask that does not cover the tokens is a mistake
    with pytest.raises(UserError, match="per_sequence"):
        hf(x, attention_mask=torch.tensor([[0] + [1] * 8, [1] * 9]))
    with pytest.raises(ValueError, match="attention_mask"):
        hf(x, attention_mask=torch.ones(2, 3))
    with torch.no_grad():
        cache = hf(x[:1]).past_key_values
        with pytest.raises(ValueError, match="1 sequences"):
            hf(x, past_key_values=cache)
        assert not cache.is_croppable
        with pytest.raises(NotImplementedError):
            cache.crop(1)
        branch = copy.deepcopy(cache)  # branching from one prefix: the model updates the given cache in place
        a = hf(x[:1, :2], past_key_values=cache)
        b = hf(x[:1, :2], past_key_values=branch)
        assert a.past_key_values is cache and cache.get_seq_length() == 11
        assert torch.equal(a.logits, b.logits)



def test_forward_loss_leaves_padded_labels_out():
    """``labels`` given with an ``attention_mask`` (a left-padded batch, as a Trainer's collator gives it): the
    loss is the mean over the real positions' next tokens only, padding never a target, whatever label the padded
    positions carry (here the padding's own random tokens, not -100). Mutation caught: the labels not masked by
    ``attention_mask`` (padded positions counted in the loss; issue 49)."""
    lm = tiny_model("mixer", "attention", seed=3)
    hf = FastWeightsForCausalLM.from_language_model(lm)
    x = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0  # the second row left-padded: 5 real tokens
    with torch.no_grad():
        out = hf(x, attention_mask=mask, labels=x, use_cache=False)
        logits = out.logits[:, :-1].float().flatten(0, 1)
        want = torch.nn.functional.cross_entropy(logits, x.masked_fill(mask == 0, -100)[:, 1:].flatten(),
                                                 ignore_index=-100)
        with_padding = torch.nn.functional.cross_entropy(logits, x[:, 1:].flatten())
    torch.testing.assert_close(out.loss.float(), want)
    assert abs(float(with_padding - want)) > 1e-3  # the padded labels would move the loss


# ----------------------------------------------------------------------------- export-hf

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll: Speak, speak.\n"


SEQ_LEN = 8  # short training context: generation below runs past it, so the bounded KV cache matters


def _checkpoint(tmp_path, tokenizer_kind: str, seed: int):
    tok = build_tokenizer(tokenizer_kind, TEXT)
    cfg = RunConfig(model=ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=2, n_heads=2, init_std=0.3,
                                      layer_mixers=["attention", "fwp"]))
    cfg.data.tokenizer = tokenizer_kind
    cfg.train.seq_len = SEQ_LEN
    torch.manual_seed(seed)
    lm = LanguageModel(cfg.model).eval()
    ck = tmp_path / "ckpt"
    save_model(lm, ck, cfg, tok)
    return ck, lm, tok


def _cli(argv, monkeypatch):
    from fastweights import cli

    return cli.main(argv)


@pytest.mark.parametrize("tokenizer_kind", ["char", "byte", "gpt2"])
def test_export_hf_round_trip(tokenizer_kind, tmp_path, monkeypatch, capsys):
    ck, lm, tok = _checkpoint(tmp_path, tokenizer_kind, seed=8)
    out = tmp_path / "hf"
    assert _cli(["export-hf", str(ck), str(out)], monkeypatch) == 0
    assert "exported" in capsys.readouterr().out
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]:
        assert (out / f).is_file(), f
    assert json.loads((out / "config.json").read_text())["model_type"] == "fastweights"

    model = AutoModelForCausalLM.from_pretrained(out)
    hf_tok = AutoTokenizer.from_pretrained(out)
    # text: same ids as ours, including unseen characters (char: the unknown id), and the same decoding
    probe = "Before we speak, Zounds! ☃ naïve <|endoftext|>\n\tend"
    ids = hf_tok(probe)["input_ids"]
    assert ids == tok.encode(probe).tolist()
    assert hf_tok.decode(ids) == tok.decode(ids)
    # logits
    x = torch.tensor([tok.encode(TEXT[:40]).tolist()])
    with torch.no_grad():
        assert torch.equal(model(x).logits, lm(x).logits)
    # greedy generation through the tokenizers equals `fastweights generate --temperature 0`, whose
    # attention layers keep the training context (SEQ_LEN) as the exported model's do
    assert model.config.attention_context == SEQ_LEN
    prompt, n_new = "All: ", 3 * SEQ_LEN
    enc = hf_tok(prompt, return_tensors="pt")
    new = model.generate(**enc, max_new_tokens=n_new, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    ours = list(generate_tokens(lm, tok.encode(prompt).tolist(), n_new, temperature=0, context=SEQ_LEN))
    unbounded = list(generate_tokens(lm, tok.encode(prompt).tolist(), n_new, temperature=0))
    if tokenizer_kind == "gpt2":  # generate() stops at <|endoftext|>; ours runs on
        eot = tok.eot_id
        assert model.generation_config.eos_token_id == eot == hf_tok.eos_token_id
        if eot in ours:
            ours, unbounded = ours[: ours.index(eot) + 1], unbounded[: ours.index(eot) + 1]
    assert new == ours
    assert new != unbounded or len(new) < SEQ_LEN  # the bound changed the continuation: it was exercised
    if len(new) == n_new:
        assert _cli(["generate", "--checkpoint", str(ck), "--prompt", prompt, "--max-tokens", str(n_new),
                     "--temperature", "0", "--device", "cpu"], monkeypatch) == 0
        assert capsys.readouterr().out == prompt + hf_tok.decode(new) + "\n"


def test_export_hf_refuses_non_empty_dir_and_checkpoint(tmp_path, monkeypatch, capsys):
    ck, _, _ = _checkpoint(tmp_path, "char", seed=9)
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert _cli(["export-hf", str(ck), str(out)], monkeypatch) == 2
    assert "not empty" in capsys.readouterr().err
    assert _cli(["export-hf", str(ck), str(ck)], monkeypatch) == 2
    assert "differ" in capsys.readouterr().err
    assert _cli(["export-hf", str(tmp_path / "missing"), str(tmp_path / "o")], monkeypatch) == 2
    assert _cli(["export-hf", str(ck), str(out), "--force"], monkeypatch) == 0
    assert (out / "keep.txt").is_file() and (out / "model.safetensors").is_file()


def test_exported_directory_loads_for_dynamic_evaluation_in_a_fresh_process(tmp_path, monkeypatch):
    """`fastweights dynamic eval --hf DIR` on an export-hf directory: the loader registers our model type."""
    import subprocess
    import sys

    ck, lm, tok = _checkpoint(tmp_path, "char", seed=10)
    out = tmp_path / "hf"
    assert _cli(["export-hf", str(ck), str(out)], monkeypatch) == 0
    text = TEXT * 3
    code = ("import sys; from fastweights.cli import main; "
            "sys.exit(main(['dynamic', 'eval', '--hf', sys.argv[1], '--data', sys.argv[2], '--json', '--quiet', "
            "'--rule', 'sgd', '--lr', '0.01', '--segment-len', '4', '--context', '8']))")
    (tmp_path / "doc.txt").write_text(text)
    r = subprocess.run([sys.executable, "-c", code, str(out), str(tmp_path / "doc.txt")], capture_output=True,
                       text=True, timeout=HANG_GUARD_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["static"]["tokens"] == got["dynamic"]["tokens"] == len(tok.encode(text)) - 1


def test_exported_directory_loads_with_trust_remote_code_and_asks_for_it_otherwise(tmp_path, monkeypatch):
    """Without `import fastweights.hf.ours_as_transformers`: the export's auto_map makes transformers ask for
    trust_remote_code (not suggest upgrading it), and with it load our model through the installed package."""
    import subprocess
    import sys

    ck, lm, tok = _checkpoint(tmp_path, "char", seed=11)
    out = tmp_path / "hf"
    assert _cli(["export-hf", str(ck), str(out)], monkeypatch) == 0
    x = [int(i) for i in tok.encode(TEXT[:12])]
    code = ("import sys, json, torch, transformers\n"
            "try:\n"
            "    transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "    print('loaded without trust')\n"
            "except Exception as e:\n"
            "    print('trust_remote_code' in str(e), 'upgrade' in str(e).lower())\n"
            "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
            "print(json.dumps(m(torch.tensor([json.loads(sys.argv[2])])).logits[0, -1].tolist()))\n")
    r = subprocess.run([sys.executable, "-c", code, str(out), json.dumps(x)], capture_output=True, text=True,
                       timeout=HANG_GUARD_S, stdin=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    first, logits = r.stdout.strip().splitlines()[-2:]
    assert first.endswith("True False")  # transformers prints its [y/N] prompt on the same line
    with torch.no_grad():
        want = lm(torch.tensor([x])).logits[0, -1]
    torch.testing.assert_close(torch.tensor(json.loads(logits)), want, rtol=1e-5, atol=1e-5)


def test_a_model_directory_of_integer_weights_is_refused(tmp_path, capsys):
    """Issue 52: an HF directory whose weights were int8 (no quantization) loaded as zeros and was scored, exit 0."""
    import json

    from safetensors.torch import load_file, save_file

    from fastweights.cli import main
    from helpers import tiny_llama_dir

    d = tiny_llama_dir(tmp_path / "llama")
    (tmp_path / "doc.txt").write_text("The cat sat on the mat. " * 8)
    args = ["dynamic", "eval", "--hf", str(d), "--data", str(tmp_path / "doc.txt"), "--rule", "sgd", "--lr", "0",
            "--quiet"]
    assert main(args) == 0
    capsys.readouterr()
    for path in d.glob("*.safetensors"):
        save_file({k: v.to(torch.int8) for k, v in load_file(str(path)).items()}, str(path))
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "I8" in err and "no quantization" in err and len(err.splitlines()) == 1
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "x"}}))
    from fastweights.hf.transformers_as_ours import _refuse_integer_weights

    _refuse_integer_weights(d)  # a quantised model's integers are its design


def test_a_safetensors_header_length_past_any_real_header_is_not_read(tmp_path):
    """The integer-weights check reads only headers: a file whose first 8 bytes give a header of 2^64 - 1 bytes
    (damaged or hostile) is left to transformers to report, not read into memory (seed 18: the size guard
    `or True` survived; reading it raises OverflowError, a traceback)."""
    from fastweights.hf.transformers_as_ours import _refuse_integer_weights

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes((2**64 - 1).to_bytes(8, "little") + b"{}")
    _refuse_integer_weights(tmp_path)


def test_a_link_planted_after_the_exports_first_check_is_refused_by_its_writer(tmp_path, monkeypatch):
    """``export-hf --force`` checks the directory's entries first, then loads the checkpoint, then writes: a link
    planted in between (here while the checkpoint loads) is refused by the writer itself, naming the export
    (seed-16 mutation draw: the writer not told what it writes)."""
    import fastweights.models.loading as loading
    from fastweights.core.errors import UserError
    from fastweights.hf.export import export_hf

    ck, _, _ = _checkpoint(tmp_path, "char", seed=3)
    out, victim = tmp_path / "exp", tmp_path / "victim.json"
    out.mkdir()
    victim.write_text("{}")
    real = loading.load_checkpoint

    def load_then_plant(*a, **k):
        loaded = real(*a, **k)
        (out / "config.json").symlink_to(victim)
        return loaded

    monkeypatch.setattr(loading, "load_checkpoint", load_then_plant)
    with pytest.raises(UserError) as e:
        export_hf(ck, out, force=True)
    assert str(e.value) == (f"{out / 'config.json'} is a symbolic link; refusing to write the export through it "
                            "(remove the link)")
    assert victim.read_text() == "{}" and sorted(p.name for p in out.iterdir()) == ["config.json"]
