"""Exports that load quietly (issue 40, scope 4): a directory written by `export-hf` (char, byte and gpt2
tokenizers) or by `fwl-head export` loads with `AutoTokenizer` and `AutoModelForCausalLM` in each way the docs
state -- after `import fastweights.hf.ours_as_transformers` (`fwl_as_transformers` for the FWL head), or with
`trust_remote_code=True` -- with no question and no warning: each is run in a fresh interpreter with warnings as
errors and stdin closed, whose stderr may hold nothing but transformers' own progress bars. The tokenizer alone
loads through its class with neither; without either, AutoTokenizer asks (as the docs say: it reads config.json).
The gpt2 tokenizer is saved as transformers' GPT2Tokenizer and gives our ids; plain `import fastweights` stays
light (it does not import transformers)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import fastweights  # noqa: E402
from fastweights import cli  # noqa: E402
from fastweights.checkpoints.format import save_model  # noqa: E402
from fastweights.core.config import ModelConfig, RunConfig  # noqa: E402
from fastweights.data import build_tokenizer  # noqa: E402
from fastweights.models.lm import LanguageModel  # noqa: E402
from helpers import HANG_GUARD_S, gpt2_tokenizer  # noqa: E402

SRC = Path(fastweights.__file__).resolve().parents[1]
TEXT = "ROMEO: But soft, what light through yonder window breaks? It is the east.\n" * 4
PROBE = "Before we speak, Zounds! \u2603 na\u00efve <|endoftext|>\n\tend  "
KINDS = ("char", "byte", "gpt2")
# transformers' own progress bars (tqdm, on stderr): "Loading weights: 100%|...| 14/14 [...]"
PROGRESS = re.compile(r"^(Loading weights|Writing model shards|Loading checkpoint shards)\b")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{kind: directory}: `fastweights export-hf` of a tiny checkpoint per tokenizer, and `fwl` -> the FWL head's
    export (a tiny Llama with the bundled GPT-2 tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastweights.hf.fwl_as_transformers import export_fwl_head
    from fastweights.hf.fwl_head import HFCausalLMWithFWL
    from fastweights.hf.transformers_as_ours import HFCausalLM

    root = tmp_path_factory.mktemp("exports")
    out = {}
    for kind in KINDS:
        tok = build_tokenizer(kind, TEXT)
        cfg = RunConfig(model=ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=2, n_heads=2,
                                          layer_mixers=["attention", "fwp"]))
        cfg.data.tokenizer = kind
        cfg.train.seq_len = 16
        torch.manual_seed(0)
        save_model(LanguageModel(cfg.model).eval(), root / f"ck-{kind}", cfg, tok)
        assert cli.main(["export-hf", str(root / f"ck-{kind}"), str(root / kind)]) == 0
        out[kind] = root / kind
    (root / "gpt2-files").mkdir()
    hf_tok = gpt2_tokenizer(root / "gpt2-files")
    torch.manual_seed(0)
    backbone = LlamaForCausalLM(LlamaConfig(vocab_size=len(hf_tok), hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                            max_position_embeddings=256, tie_word_embeddings=True)).eval()
    export_fwl_head(HFCausalLMWithFWL(HFCausalLM(backbone)), hf_tok, root / "fwl")
    out["fwl"] = root / "fwl"
    return out


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter as a user runs it: warnings are errors, stdin is closed (a question
    would read end of file), transformers' module cache and hub are a fresh offline folder."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("TRANSFORMERS_VERBOSITY", None)
    return subprocess.run([sys.executable, "-W", "error", "-c", code], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)


def _noise(stderr: str) -> list[str]:
    """Every piece of stderr that is not a transformers progress bar (tqdm redraws with carriage returns)."""
    pieces = (p.strip() for line in stderr.splitlines() for p in line.split("\r"))
    return [p for p in pieces if p and not PROGRESS.match(p)]


_LOAD = """
import json
from transformers import AutoModelForCausalLM, AutoTokenizer
out = {}
for kind, d in json.loads(%(dirs)r).items():
    tok = AutoTokenizer.from_pretrained(d%(flag)s)
    model = AutoModelForCausalLM.from_pretrained(d%(flag)s)
    out[kind] = {"tokenizer": type(tok).__name__, "model": type(model).__module__ + "." + type(model).__name__,
                 "ids": tok(%(probe)r)["input_ids"]}
print(json.dumps(out))
"""


def _ours(kind: str) -> list[int]:
    return build_tokenizer(kind, TEXT).encode(PROBE).tolist()


def _backbone_ids(exports) -> list[int]:
    """The FWL export's tokenizer is the backbone's own (transformers' GPT2Tokenizer from the bundled files)."""
    from transformers import GPT2Tokenizer

    files = exports["fwl"].parent / "gpt2-files"
    return GPT2Tokenizer(str(files / "vocab.json"), str(files / "merges.txt"))(PROBE)["input_ids"]


@pytest.mark.parametrize("way", ["import", "trust_remote_code"])
def test_every_export_loads_with_no_question_and_no_warning(exports, tmp_path, way):
    dirs = json.dumps({k: str(v) for k, v in exports.items()})
    imports = "import fastweights.hf.ours_as_transformers, fastweights.hf.fwl_as_transformers\n" if way == "import" else ""
    flag = ", trust_remote_code=True" if way == "trust_remote_code" else ""
    r = _run(imports + _LOAD % {"dirs": dirs, "flag": flag, "probe": PROBE}, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _noise(r.stderr) == [], r.stderr[-3000:]
    assert "[y/N]" not in r.stdout + r.stderr and "custom code" not in r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for kind in KINDS:
        assert got[kind]["model"] == "fastweights.hf.ours_as_transformers.FastWeightsForCausalLM"
        assert got[kind]["ids"] == _ours(kind), kind
    assert got["gpt2"]["tokenizer"] == "GPT2Tokenizer"  # a class transformers knows, where the vocabulary allows it
    assert got["char"]["tokenizer"] == got["byte"]["tokenizer"] == "TokenizersBackend"  # transformers' generic class
    assert got["fwl"]["model"] == "fastweights.hf.fwl_as_transformers.FWLHeadForCausalLM"
    assert got["fwl"]["tokenizer"] == "GPT2Tokenizer" and got["fwl"]["ids"] == _backbone_ids(exports)


def test_the_tokenizer_alone_loads_through_its_class_with_neither(exports, tmp_path):
    dirs = json.dumps({k: str(v) for k, v in exports.items()})
    r = _run(f"""
import json
from transformers import PreTrainedTokenizerFast
print(json.dumps({{k: PreTrainedTokenizerFast.from_pretrained(d)({PROBE!r})["input_ids"]
                  for k, d in json.loads({dirs!r}).items()}}))
""", tmp_path)
    assert r.returncode == 0 and _noise(r.stderr) == [], r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert {k: got[k] for k in KINDS} == {k: _ours(k) for k in KINDS} and got["fwl"] == _backbone_ids(exports)


def test_without_the_import_or_the_flag_transformers_asks_as_the_docs_say(exports, tmp_path):
    """What the docs warn of (so that they say it only while it is true): AutoTokenizer reads config.json, whose
    model type only the import registers and whose auto_map names our module, so transformers asks."""
    r = _run(f"from transformers import AutoTokenizer\nAutoTokenizer.from_pretrained({str(exports['char'])!r})",
             tmp_path)
    assert "Do you wish to run the custom code? [y/N]" in r.stdout + r.stderr


def test_plain_import_fastweights_stays_light():
    """The docs name `import fastweights.hf.ours_as_transformers` (which costs torch and transformers, seconds):
    `import fastweights` alone registers nothing and imports neither."""
    r = subprocess.run([sys.executable, "-W", "error", "-c",
                        "import sys, fastweights; print(sorted({'torch', 'transformers'} & set(sys.modules)))"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)},
                       stdin=subprocess.DEVNULL, timeout=HANG_GUARD_S)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_the_exports_say_how_to_load_them(exports):
    for kind, module in (("char", "ours_as_transformers"), ("fwl", "fwl_as_transformers")):
        cfg = json.loads((exports[kind] / "config.json").read_text())
        remote = cfg["auto_map"]["AutoModelForCausalLM"].split(".")[0]
        text = (exports[kind] / f"{remote}.py").read_text()
        assert f"import fastweights.hf.{module}" in text and "trust_remote_code=True" in text


def test_the_auto_map_names_the_config_and_the_causal_lm_class():
    """What ``from_pretrained(DIR, trust_remote_code=True)`` reads in config.json (seed-14 mutation draw: the
    causal LM's key misspelt still loaded here, through the model type the config's import registers)."""
    from fastweights.hf.export import remote_code
    from fastweights.hf.ours_as_transformers import FastWeightsConfig, FastWeightsForCausalLM

    auto_map, source = remote_code("ours_as_transformers", FastWeightsConfig, FastWeightsForCausalLM)
    assert auto_map == {"AutoConfig": "ours_as_transformers.FastWeightsConfig",
                        "AutoModelForCausalLM": "ours_as_transformers.FastWeightsForCausalLM"}
    assert "from fastweights.hf.ours_as_transformers import FastWeightsConfig, FastWeightsForCausalLM" in source
