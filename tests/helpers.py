"""What several test files share: the repository's paths, tiny-model builders, the registry's test cases and
a repetitive token stream. A plain module (``tests/`` is on ``sys.path``, see ``conftest.py``): tests import
from here, never from another test module."""

import contextlib
import functools
import importlib
import io
import math
import os
import re
import signal
import subprocess
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
PACKAGE = ROOT / "src" / "fastweights"
BENCHMARKS = ROOT / "benchmarks"  # scripts in speed/, quality/ and gpu/; results in results/
TOOLS = ROOT / "tools"  # the repository's tools: the report, behaviour probes and stamping, mutation testing


def benchmark_script(name: str) -> Path:
    """``benchmarks/KIND/NAME.py``, whichever folder of kind holds the script ``name``, or ``tools/NAME.py``."""
    found = sorted([*BENCHMARKS.glob(f"*/{name}.py"), *TOOLS.glob(f"{name}.py")])
    assert len(found) == 1, f"script {name}.py: {found or 'in no folder of benchmarks/ nor in tools/'}"
    return found[0]


# the library's helpers that add flags to a benchmark script's parser, and the module that holds each
SHARED_FLAG_HELPERS = {"benchmark_threads_flag": PACKAGE / "evidence" / "script_args.py"}


@functools.cache
def benchmark_flags(script: str) -> frozenset[str]:
    """The flags the benchmark script ``script`` (a path from the repository root) names in its text, and those of
    the shared helpers it calls; empty when there is no such script."""
    path = ROOT / script
    if not path.is_file():
        return frozenset()
    text = path.read_text()
    text += "".join(module.read_text() for helper, module in SHARED_FLAG_HELPERS.items() if f"{helper}(" in text)
    return frozenset(re.findall(r'"(--?[\w-]+)"', text))


def import_benchmark(name: str):
    """The benchmark script ``name`` as a module, imported as ``python benchmarks/KIND/NAME.py`` sees its folder
    (on ``sys.path`` while it imports, removed after)."""
    folder = str(benchmark_script(name).parent)
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


#: how long a test waits for a subprocess before calling it hung: a guard, never a speed limit (a 2-core machine at
#: load 6-16 runs a 20-second command for minutes; issue 49: no test may depend on wall-clock time)
HANG_GUARD_S = 600


@contextlib.contextmanager
def registry_restored():
    """The component registry (mixers, heads, memories) as it is on entry, built-ins loaded first, restored on exit:
    a test or a docs block may register components without leaking them into later tests in the process."""
    from fastweights import components

    components.load_providers()  # a first lazy load inside the block would otherwise be undone with it
    tables = (components.MIXERS, components.HEADS, components.MEMORIES)
    saved = [dict(t) for t in tables]
    try:
        yield
    finally:
        for table, before in zip(tables, saved):
            table.clear()
            table.update(before)


@contextlib.contextmanager
def signal_at_step(metrics: Path, step: int, signum: int = signal.SIGINT):
    """While the block runs, send ``signum`` to this process once the training run logging to ``metrics`` (its
    ``metrics.jsonl``) has logged step ``step`` or later: the trainer then saves and stops at that step."""
    stop = threading.Event()

    def go():
        while not stop.is_set():
            if metrics.is_file():
                steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
                if steps and steps[-1] >= step:
                    os.kill(os.getpid(), signum)
                    return
            time.sleep(0.005)

    threading.Thread(target=go, daemon=True).start()
    try:
        yield
    finally:
        stop.set()


def run_script(script: Path, *args: str, timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` from the repository root on one torch thread, stdout and stderr captured; a device
    machine's ``$OUT`` is not passed on (a script writes where its arguments say)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def once_per_run(tmp_path_factory, name: str, make) -> dict:
    """``make(folder)``'s JSON value, computed once per pytest run even where xdist workers run the test files that
    ask for it: the first computes it in ``folder`` (under the workers' common temporary root), the others wait on
    a lock and read it. A ``make`` that raises leaves nothing, so the next asker tries again."""
    from filelock import FileLock  # torch's own dependency

    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    folder, value = root / f"once-{name}", root / f"once-{name}.json"
    with FileLock(str(value) + ".lock"):
        if not value.is_file():
            folder.mkdir(exist_ok=True)
            value.write_text(json.dumps(make(folder)))
        return json.loads(value.read_text())


def gpu_queue_dry_run(tmp_path_factory) -> dict:
    """``benchmarks/gpu/gpu_queue.py``'s CPU dry run (every item, one made to fail: ``GPU_QUEUE_FAIL``), once per
    pytest run: its output folder, exit status, stdout and stderr. The queue's FWL-recipe item runs
    ``benchmarks/gpu/fwl_smollm2_gpu.py --device cpu --tiny``, whose JSON tests/cli/test_fwl_gpu_recipe.py reads
    from here rather than running it again."""

    def make(folder: Path) -> dict:
        r = run_script(BENCHMARKS / "gpu" / "gpu_queue.py", "--device", "cpu", "--tiny", "--all", "--fail",
                       GPU_QUEUE_FAIL, "--out", str(folder))  # --all: the items done on a GPU too
        return {"out": str(folder), "returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}

    return once_per_run(tmp_path_factory, "gpu-queue-dry-run", make)


GPU_QUEUE_FAIL = "like/delta_op_T8192"  # the item the shared dry run makes fail


def json_shape(value):
    """The shape of a JSON document: each object's keys in order with their values' shapes, a list as the shape of
    its first item, a leaf as its type's name. A test compares it to a command's documented output whole, so a key
    renamed, dropped or added, or a number written as a string or null, fails."""
    if isinstance(value, dict):
        return {k: json_shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_shape(value[0])] if value else []
    return type(value).__name__


SHAPES = Path(__file__).resolve().parent / "shapes"
PROVENANCE_KEYS = ("machine", "git")  # what a machine or a checkout adds (a GPU, an installed copy): "dict" only


def assert_json_shape(document: dict, name: str) -> None:
    """``document`` (a command's JSON output) has the shape stored in ``tests/shapes/NAME.json`` (:func:`json_shape`,
    provenance's machine-dependent parts as "dict"). A command whose output changes on purpose is re-recorded with
    ``FASTWEIGHTS_RECORD_SHAPES=1 pytest ...`` and the stored file's diff reviewed: the shape is its documented
    interface (scripts read these keys)."""
    shape = json_shape({k: ({} if k in PROVENANCE_KEYS else v) for k, v in document.items()})
    shape = {k: ("dict" if k in PROVENANCE_KEYS else v) for k, v in shape.items()}
    stored = SHAPES / f"{name}.json"
    if os.environ.get("FASTWEIGHTS_RECORD_SHAPES") == "1":
        stored.parent.mkdir(exist_ok=True)
        stored.write_text(json.dumps(shape, indent=1) + "\n")
    assert stored.is_file(), f"no stored shape {stored.name}: record it with FASTWEIGHTS_RECORD_SHAPES=1"
    assert shape == json.loads(stored.read_text()), f"{name}: the output's keys or types changed (see {stored})"


_TMP = re.compile(r"/\S*?pytest-of-[^/]+/pytest-\d+/(?:popen-gw\d+/)?[^/\s'\"]+")
_MACHINE = re.compile(r"(\w+ has) [\d.,]+ GiB available")  # the memory free on this machine now
_RECORDED_LINE_CALLS: dict[str, int] = {}


def assert_recorded_line(line: str, book: str) -> None:
    """``line`` (a command's one error line) is, to the letter, the line recorded for this place of this test in
    ``tests/shapes/BOOK.json`` (keyed by the test's id and how many lines it checked before; pytest's temporary
    folders as ``{tmp}``). A test that names only the setting a message is about still pins the whole message:
    its words, the values it quotes and the advice it gives. Re-record on purpose with
    ``FASTWEIGHTS_RECORD_SHAPES=1`` (one process) and review the diff."""
    test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    n = _RECORDED_LINE_CALLS[test] = _RECORDED_LINE_CALLS.get(test, -1) + 1
    key, line = f"{test}#{n}", _MACHINE.sub(r"\1 * GiB available", _TMP.sub("{tmp}", line))
    stored = SHAPES / f"{book}.json"
    book_lines = json.loads(stored.read_text()) if stored.is_file() else {}
    if os.environ.get("FASTWEIGHTS_RECORD_SHAPES") == "1":
        book_lines[key] = line
        stored.parent.mkdir(exist_ok=True)
        stored.write_text(json.dumps(dict(sorted(book_lines.items())), indent=1, ensure_ascii=False) + "\n")
    assert key in book_lines, f"no recorded line for {key}: record it with FASTWEIGHTS_RECORD_SHAPES=1"
    assert line == book_lines[key], f"{key}: the message changed:\n  now:      {line}\n  recorded: {book_lines[key]}"


def line_matches(pattern: str, line: str) -> bool:
    """``line`` is ``pattern`` to the letter, where each ``*`` in the pattern stands for any text (a number that
    depends on the machine, a content hash): a test that reads the whole of a message, not its first words."""
    return re.fullmatch(".*".join(re.escape(part) for part in pattern.split("*")), line) is not None


def bad_input_exits(name: str, argvs: list[list[str]], capsys):
    """(argv, exit status, stdout, stderr) of benchmark script ``name`` on each argument list: the first as a real
    process (``python SCRIPT``: its ``sys.exit(exit_status_of(main))`` wiring), the others through ``main(argv)``
    in this process and ``exit_status_of`` (a Python start and torch's import saved per case)."""
    from fastweights.cli.script_parser import exit_status_of

    module = import_benchmark(name)
    for i, argv in enumerate(argvs):
        if i == 0:
            r = run_script(benchmark_script(name), *argv)
            yield argv, r.returncode, r.stdout, r.stderr
        else:
            capsys.readouterr()
            status = exit_status_of(lambda: module.main(argv))
            yield (argv, status, *capsys.readouterr())


DATA = Path(__file__).resolve().parent / "data"  # files the tests read (memory_golden.pt)


import pytest  # noqa: E402
import torch  # noqa: E402

from fastweights.core.config import ModelConfig  # noqa: E402
from fastweights.models.lm import LanguageModel  # noqa: E402
from fastweights.testing.registry_cases import VARIANTS  # noqa: E402

# ----------------------------------------------------------------------------- tiny language models


def component_fields(kind: str, name: str, memory_layer: int = 0) -> dict:
    """The ModelConfig fields that put registered component ``name`` of ``kind`` into a model."""
    return {"mixer": {"mixer": name}, "head": {"head": name},
            "memory": {"memory": name, "memory_layers": [memory_layer]}}[kind]


def tiny_lm(vocab_size: int, *, seed: int = 0, dtype: torch.dtype | None = None, training: bool = False,
            d_model: int = 16, n_layers: int = 2, n_heads: int = 2, **fields) -> LanguageModel:
    """A small LanguageModel (``fields``: any other ModelConfig field), built right after
    ``torch.manual_seed(seed)``, cast to ``dtype`` if given, in eval mode unless ``training``."""
    torch.manual_seed(seed)
    model = LanguageModel(ModelConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                                      **fields))
    if dtype is not None:
        model = model.to(dtype)
    return model.train(training)


def motif_tokens(n: int, vocab_size: int, seed: int = 1) -> torch.Tensor:
    """A repetitive stream (a short random motif with 20% noise), so adaptation has something to learn."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, vocab_size, (7,), generator=g)
    seq = motif.repeat(n // 7 + 1)[:n].clone()
    noise = torch.rand(n, generator=g) < 0.2
    seq[noise] = torch.randint(0, vocab_size, (int(noise.sum()),), generator=g)
    return seq


# ----------------------------------------------------------------------------- registered components


def variant_cases(known: dict | None = None, key=lambda kind, name, vid: (kind, name)):
    """pytest params ``(kind, name, raw)`` for every registered component and variant, id ``kind-name-variant``;
    ``known`` maps ``key(kind, name, vid)`` to the reason of a strict xfail."""
    for (kind, name), variants in VARIANTS.items():
        for vid, raw in variants.items():
            why = (known or {}).get(key(kind, name, vid))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            yield pytest.param(kind, name, raw, id=f"{kind}-{name}-{vid}", marks=marks)


# ----------------------------------------------------------------------------- streaming in pieces


def in_pieces(layer, x, lengths, *aligned, state=None):
    """``layer(x_piece, *aligned_pieces, state)`` over consecutive pieces of the given ``lengths`` along dim 1
    (the last piece takes what is left), the state carried: (outputs concatenated along dim 1, last state)."""
    outs, at = [], 0
    for n in [*lengths, x.shape[1] - sum(lengths)]:
        if n:
            y, state = layer(x[:, at:at + n], *(a[:, at:at + n] for a in aligned), state)
            outs.append(y)
        at += n
    return torch.cat(outs, 1), state


def assert_lm_pieces_equal_one_call(model, tokens, cuts, atol=1e-10, rtol=0.0):
    """A language model's logits over ``tokens`` in one call equal those of calls cut at ``cuts``, each
    continuing the state the previous one returned."""
    full = model(tokens).logits
    logits, state = [], None
    for lo, hi in zip((0, *cuts), (*cuts, tokens.shape[1])):
        out = model(tokens[:, lo:hi], state)
        logits.append(out.logits)
        state = out.state
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- operator inputs


def op_inputs(b, t, h, dk, dv, dtype=torch.float64, seed=0, unit_keys=False, positive=False):
    """Random (q, k, v, beta, log_decay, s0) for the linear-attention and delta-rule operators: q, v ~ N(0, 1),
    k ~ N(0, 1) / sqrt(dk) (L2-normalised rows with ``unit_keys``), q and k made non-negative with
    ``positive``, beta ~ U(0, 1), log_decay ~ -U(0, 0.3), an initial state s0 ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, dk, generator=g, dtype=dtype)
    k = torch.randn(b, t, h, dk, generator=g, dtype=dtype)
    k = torch.nn.functional.normalize(k, dim=-1) if unit_keys else k / dk**0.5
    if positive:
        q, k = q.abs(), k.abs()
    v = torch.randn(b, t, h, dv, generator=g, dtype=dtype)
    beta = torch.rand(b, t, h, generator=g, dtype=dtype)
    log_decay = -torch.rand(b, t, h, generator=g, dtype=dtype) * 0.3
    s0 = torch.randn(b, h, dk, dv, generator=g, dtype=dtype)
    return q, k, v, beta, log_decay, s0


# ----------------------------------------------------------------------------- scoring without leaks


def own_token_probabilities(evaluate, x: torch.Tensor, j: int, vocab_size: int) -> tuple[list, list]:
    """For every value of x_j: p(x_j | x_<j), and the losses before position j. ``evaluate(tokens)`` returns a
    result whose ``token_losses[i]`` scores ``tokens[i + 1]``."""
    probs, before = [], []
    for c in range(vocab_size):
        y = x.clone()
        y[j] = c
        losses = evaluate(y).token_losses
        probs.append(math.exp(-losses[j - 1]))
        before.append(losses[: j - 1])
    return probs, before


def assert_score_ignores_its_own_token(evaluate, x: torch.Tensor, j: int, vocab_size: int) -> None:
    """p(x_j | x_<j) summed over every value of x_j is 1 (an update that saw x_j before scoring it would raise
    its own probability and the sum would exceed 1), and the scores before j do not move when x_j changes."""
    probs, before = own_token_probabilities(evaluate, x, j, vocab_size)
    assert abs(sum(probs) - 1) < 1e-9
    assert all(b == before[0] for b in before[1:])


# ----------------------------------------------------------------------------- Hugging Face models (the [hf] extra)


def tiny_gpt2(vocab_size: int, positions: int, layers: int = 2, dtype: torch.dtype = torch.float64, **config):
    """A randomly initialised GPT-2 (32 wide, 2 heads; seed 0) in eval mode: no download."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=vocab_size, n_positions=positions, **config)
    return GPT2LMHeadModel(cfg).to(dtype).eval()


def tiny_llama(vocab_size: int, positions: int, layers: int = 2, dtype: torch.dtype = torch.float64):
    """A randomly initialised Llama (32 wide, 2 heads, 1 KV head, rotary; seed 0) in eval mode: no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def stderr_text(capsys) -> str:
    """What a command printed on stderr, stripped; never a traceback."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err


def resign_manifest(d: Path) -> None:
    """Rewrite checkpoint.json's sizes and hashes (what an attacker who edits a run directory does)."""
    import hashlib
    import json

    m = json.loads((d / "checkpoint.json").read_text())
    for name in m["files"]:
        data = (d / name).read_bytes()
        m["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (d / "checkpoint.json").write_text(json.dumps(m))


def untrained_char_checkpoint(d: Path, text: str, out: Path | None = None) -> Path:
    """An untrained char-level checkpoint (2 layers, d_model 16, seq_len 32) of ``text``'s characters, its
    corpus at ``d/corpus.txt``, saved at ``out`` (default ``d``)."""
    from fastweights.checkpoints.format import save_model
    from fastweights.core.config import RunConfig
    from fastweights.data import CharTokenizer

    (d / "corpus.txt").write_text(text)
    tok = CharTokenizer.from_text(text)
    cfg = RunConfig()
    cfg.model = ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=2, n_heads=2)
    cfg.data.corpus = str(d / "corpus.txt")
    cfg.train.seq_len = 32
    torch.manual_seed(0)
    save_model(LanguageModel(cfg.model), out or d, cfg, tok)
    return out or d


def gpt2_tokenizer(directory: Path):
    """transformers' GPT2Tokenizer from the package's bundled gpt2 files, written into ``directory``."""
    import gzip
    from importlib import resources

    from transformers import GPT2Tokenizer

    assets = resources.files("fastweights") / "data" / "assets" / "gpt2"
    for name in ("vocab.json", "merges.txt"):
        (directory / name).write_bytes(gzip.decompress((assets / f"{name}.gz").read_bytes()))
    return GPT2Tokenizer(str(directory / "vocab.json"), str(directory / "merges.txt"))


def tiny_gpt2_dir(directory: Path, name: str = "m", positions: int = 64):
    """(model, tokenizer, directory / name): a tiny random GPT-2 (1 block, 16 wide; seed 0) with the gpt2 tokenizer,
    not yet saved (``model.save_pretrained(d); tok.save_pretrained(d)`` after any edit). No downloads."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = gpt2_tokenizer(directory)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tok), n_positions=positions))
    return model, tok, directory / name


def tiny_llama_dir(directory: Path, max_positions: int = 2048, n_layers: int = 2) -> Path:
    """A tiny random Llama (seed 0, the bundled GPT-2 vocabulary, tied embeddings, ``n_layers`` decoder blocks)
    saved with its tokenizer as a local model directory in ``directory`` (created): what the FWL-head and loading
    tests run offline (``fastweights.testing.tiny_models``, which the benchmarks' dry runs build too)."""
    from fastweights.testing.tiny_models import tiny_llama_dir as build

    return build(directory, max_positions, n_layers)


def tiny_training_run(out: Path, steps: int) -> Path:
    """``fastweights train --preset tiny`` for ``steps`` steps without validation, into ``out``."""
    from fastweights.cli import main

    assert main(["train", "--preset", "tiny", "--quiet", "--set", f"train.max_steps={steps}",
                 "--set", "train.eval_every=0", "--out", str(out)]) == 0
    return out


class FakeTime:
    """A stand-in for the ``time`` module of the code under test (``perf_counter`` and ``process_time``
    read ``t``): the test advances ``t`` as slowed work would."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def perf_counter(self):
        return self.t

    process_time = perf_counter


class TimedLog(io.StringIO):
    """stderr that records when, on a :class:`FakeTime`, each line was written (``lines``: (t, line)); not a
    terminal."""

    def __init__(self, clock: FakeTime):
        super().__init__()
        self.clock, self.lines = clock, []

    def write(self, s):
        self.lines += [(self.clock.t, line) for line in s.splitlines() if line.strip()]
        return super().write(s)

    def isatty(self):
        return False


def stored_results_covering_every_probe_kind() -> list[str]:
    """Stored results covering every probe kind at least once (the fewest files, in name order): the evidence
    tests' sample of ``benchmarks/results``."""
    sys.path.insert(0, str(TOOLS))
    import evidence
    import probes

    chosen, kinds = [], set()
    for path in evidence.result_paths():
        found = {p["kind"] for p in json.loads(path.read_text()).get("probes") or []}
        if found - kinds:
            chosen.append(evidence.result_key(path))
            kinds |= found
    exact = {"source", "corpus"}  # kinds whose outputs are text and integers: no float kernel reaches them
    assert kinds >= set(probes.KINDS) - exact, f"no stored result probes {sorted(set(probes.KINDS) - exact - kinds)}"
    return chosen
