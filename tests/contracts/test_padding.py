"""Padding (issue 33, scope 7): a masked position (``attention_mask`` 0) is never written into any fast weight,
memory, KV cache or recurrent state, moves no position and no normaliser, so a left-padded batch gives each row
exactly what its real tokens get alone.

Registry-wide, with no list to edit: every registered mixer, head and memory, with its tiny options and every
variant it declares (``test_variants``), inside a small fp64 language model: a left-padded batch of prompts of
different lengths (the padding filled with random tokens, so a leak moves something) gives, at each row's real
positions, the logits of that prompt alone, and the returned state continues as the prompt's own (three more
steps, unpadded). Then through Hugging Face: ``generate()`` on a model written by ``export-hf`` with a
left-padded batch of prompts (the exported tokenizer pads on the left) equals generating each prompt alone,
greedy, for every registered mechanism, and with beam search for a few (the state reordered along the batch);
and ``pipeline(..., batch_size=3)`` equals ``batch_size=1``.

A fast memory shared by the batch (FwPKM / FwMLP with persistence "stream" or "official") is one memory that
every row writes: no row reads it alone, so the per-row contract is checked with its ``per_sequence``
persistence, and the shared memory is held to what it can promise: padding on the same positions of every row
equals no padding there, and rows padded differently are refused with a one-line error.
"""

import pytest
import torch

from fastweights import components as registry
from fastweights.core.errors import UserError
from helpers import component_fields, tiny_lm

VOCAB = 11
LENGTHS = (9, 5, 1, 7)  # the longest row unpadded, one row of a single token
SHARED = ("stream", "official")


def cases(shared_memories: bool):
    """(kind, name, options) for every registered component: its tiny options ("tiny") and its test variants.
    ``shared_memories``: only the variants of a memory shared by the batch; else the others, a shared
    memory's variants switched to ``persistence="per_sequence"`` (the per-row contract holds there)."""
    seen = set()
    for kind, entry in registry.registered():
        variants = {"tiny": registry.declared(entry, "tiny_options"), **registry.declared(entry, "test_variants")}
        for vid, raw in variants.items():
            raw = dict(raw)
            is_shared = kind == "memory" and getattr(registry.build_options(entry, raw), "persistence", None) in SHARED
            if is_shared != shared_memories:
                if shared_memories:
                    continue
                raw, vid = {**raw, "persistence": "per_sequence"}, f"{vid}-as-per_sequence"
            key = (kind, entry.name, tuple(sorted(raw.items())))
            if key not in seen:
                seen.add(key)
                yield pytest.param(kind, entry.name, raw, id=f"{kind}-{entry.name}-{vid}")


def build(kind, name, raw, seed=0, **fields):
    return tiny_lm(VOCAB, seed=seed, dtype=torch.float64, d_model=12,
                   **{**component_fields(kind, name), "options": {name: raw} if raw else {}, **fields})


def padded_batch(lengths=LENGTHS, seed=0):
    """Prompts of ``lengths`` left-padded into one batch: (prompts, tokens [B, T], mask [B, T]); padding holds
    random tokens, not one pad id, so a pad that leaks into a state moves the outputs."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    tokens = torch.randint(0, VOCAB, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    prompts = []
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
        prompts.append(tokens[b, T - n:])
    return prompts, tokens, mask


@pytest.mark.parametrize("kind,name,raw", list(cases(shared_memories=False)))
def test_padded_batch_equals_each_prompt_alone(kind, name, raw):
    model = build(kind, name, raw)
    prompts, tokens, mask = padded_batch()
    T = tokens.shape[1]
    nxt = torch.randint(0, VOCAB, (len(prompts), 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = model(tokens, attention_mask=mask)
        cont = model(nxt, out.state)  # the state a padded call returned, continued unpadded
        for b, p in enumerate(prompts):
            alone = model(p[None])
            torch.testing.assert_close(out.logits[b, T - len(p):], alone.logits[0], rtol=0, atol=1e-10,
                                       msg=lambda m: f"row {b} ({len(p)} real tokens): {m}")
            after = model(nxt[b:b + 1], alone.state)
            torch.testing.assert_close(cont.logits[b], after.logits[0], rtol=0, atol=1e-10,
                                       msg=lambda m: f"row {b}, continuing the padded call's state: {m}")


@pytest.mark.parametrize("kind,name,raw", list(cases(shared_memories=False)))
def test_padding_in_a_later_call_equals_each_row_alone(kind, name, raw):
    """Padding after real tokens (a padded call continuing an unpadded one's state) is skipped too."""
    model = build(kind, name, raw)
    prompts, tokens, mask = padded_batch(seed=1)
    T = tokens.shape[1]
    g = torch.Generator().manual_seed(6)
    first = torch.randint(0, VOCAB, (len(prompts), 6), generator=g)
    nxt = torch.randint(0, VOCAB, (len(prompts), 3), generator=g)
    with torch.no_grad():
        start = model(first)
        out = model(tokens, start.state, attention_mask=mask)
        cont = model(nxt, out.state)
        for b, p in enumerate(prompts):
            alone = model(p[None], model(first[b:b + 1]).state)
            torch.testing.assert_close(out.logits[b, T - len(p):], alone.logits[0], rtol=0, atol=1e-10,
                                       msg=lambda m: f"row {b} ({len(p)} real tokens): {m}")
            after = model(nxt[b:b + 1], alone.state)
            torch.testing.assert_close(cont.logits[b], after.logits[0], rtol=0, atol=1e-10,
                                       msg=lambda m: f"row {b}, continuing the padded call's state: {m}")


@pytest.mark.parametrize("kind,name,raw", list(cases(shared_memories=False)))
def test_a_row_all_padding_in_a_call_keeps_its_state(kind, name, raw):
    """A row with no real token in a call (a batch where one sequence has nothing new) keeps the state it came
    with: not reset, not moved (issue 39: every other test prompt has a real token in each call)."""
    model = build(kind, name, raw)
    g = torch.Generator().manual_seed(7)
    first = torch.randint(0, VOCAB, (3, 6), generator=g)
    middle = torch.randint(0, VOCAB, (3, 4), generator=g)
    nxt = torch.randint(0, VOCAB, (3, 3), generator=g)
    mask = torch.ones(middle.shape, dtype=torch.long)
    mask[1] = 0  # row 1: nothing real in this call
    mask[2, :2] = 0  # row 2: left-padded
    with torch.no_grad():
        out = model(middle, model(first).state, attention_mask=mask)
        cont = model(nxt, out.state)
        for b in range(3):
            state = model(first[b:b + 1]).state
            if b != 1:
                state = model(middle[b:b + 1, mask[b].bool()], state).state
            after = model(nxt[b:b + 1], state)
            torch.testing.assert_close(cont.logits[b], after.logits[0], rtol=0, atol=1e-10,
                                       msg=lambda m: f"row {b} ({int(mask[b].sum())} real tokens in the call): {m}")


@pytest.mark.parametrize("kind,name,raw", [c for c in cases(shared_memories=False) if c.id.endswith(("-tiny",
                                                                                                  "-tiny-as-per_sequence"))])
def test_a_padded_call_trains_and_continues_under_bf16_autocast(kind, name, raw):
    """The padded paths keep the dtypes of the unpadded ones (fast weights fp32 under autocast): a padded
    training call and an unpadded continuation of its state run, finite, and the loss backpropagates."""
    model = tiny_lm(VOCAB, training=True, d_model=12,
                    **{**component_fields(kind, name), "options": {name: raw} if raw else {}})
    _, tokens, mask = padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens, targets=tokens, attention_mask=mask)
        after = model(tokens[:, :2], out.state)
    out.loss.backward()
    assert torch.isfinite(out.loss) and bool(torch.isfinite(after.logits).all())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_mask_of_ones_is_no_mask_and_padding_is_not_a_target():
    model = build("mixer", "fwp", {"rule": "delta", "chunk_size": 4})
    _, tokens, mask = padded_batch()
    with torch.no_grad():
        plain = model(tokens, targets=tokens)
        ones = model(tokens, targets=tokens, attention_mask=torch.ones_like(mask))
        assert torch.equal(plain.logits, ones.logits) and torch.equal(plain.loss, ones.loss)
        padded = model(tokens, targets=tokens, attention_mask=mask)
        targets = tokens.masked_fill(mask == 0, -100)
        expected = torch.nn.functional.cross_entropy(padded.logits.flatten(0, 1), targets.flatten(),
                                                     ignore_index=-100)
        torch.testing.assert_close(padded.loss, expected)


def test_a_part_that_takes_no_mask_refuses_padding_naming_itself():
    """A mixer written before masks (no ``attention_mask`` keyword) still runs unpadded batches; given padding
    it fails with one line naming it, never silently reading the padding into its state."""

    class RunningSum(torch.nn.Module):
        def forward(self, x, state=None):
            total = x.cumsum(1) + (0 if state is None else state.unsqueeze(1))
            return total, total[:, -1]

    model = build("mixer", "attention", {})
    model.blocks[0].mixer = RunningSum()
    _, tokens, mask = padded_batch()
    with torch.no_grad():
        model(tokens, attention_mask=torch.ones_like(mask))
        with pytest.raises(UserError, match="RunningSum does not take an attention_mask"):
            model(tokens, attention_mask=mask)


@pytest.mark.parametrize("kind,name,raw", list(cases(shared_memories=True)))
def test_a_shared_memory_skips_common_padding_and_refuses_rows_padded_differently(kind, name, raw):
    model = build(kind, name, raw)
    initial = {k: t.clone() for k, t in model.state_dict().items()}  # "official" writes its tables back
    _, tokens, mask = padded_batch()
    with pytest.raises(UserError, match="per_sequence"):
        model(tokens, attention_mask=mask)
    # padding on the same positions of every row (two leading, one inside): left out of the memory
    common = torch.ones(tokens.shape, dtype=torch.long)
    common[:, :2] = 0
    common[:, 5] = 0
    real = common[0].bool()
    nxt = torch.randint(0, VOCAB, (tokens.shape[0], 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model.load_state_dict(initial)
        out = model(tokens, attention_mask=common)
        cont = model(nxt, out.state)
        model.load_state_dict(initial)
        alone = model(tokens[:, real])
        after = model(nxt, alone.state)
    torch.testing.assert_close(out.logits[:, real], alone.logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(cont.logits, after.logits, rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------- through Hugging Face

pytest.importorskip("transformers")

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll: Speak, speak.\n"
PROMPTS = ["Before we proceed", "All: ", "S", "hear me speak.\nA"]
NEW = 6  # tokens generated: past the exported attention context (SEQ_LEN) for the longest prompt
SEQ_LEN = 8


def generate_cases():
    """Every registered mechanism with its tiny options (a shared memory per sequence, see the module docstring)."""
    for kind, entry in registry.registered():
        raw = dict(registry.declared(entry, "tiny_options"))
        if kind == "memory" and hasattr(registry.build_options(entry, raw), "persistence"):
            raw["persistence"] = "per_sequence"
        yield pytest.param(kind, entry.name, raw, id=f"{kind}-{entry.name}")


def exported(tmp_path, kind, name, raw, seed=3):
    """A checkpoint with ``name`` in it written by export-hf and loaded back: (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastweights.checkpoints.format import save_model
    from fastweights.core.config import ModelConfig, RunConfig
    from fastweights.data.tokenizers import build_tokenizer
    from fastweights.hf.export import export_hf
    from fastweights.models.lm import LanguageModel

    tok = build_tokenizer("char", TEXT)
    fields = {**component_fields(kind, name), "options": {name: raw} if raw else {}}
    cfg = RunConfig(model=ModelConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, init_std=0.3,
                                      **fields))
    cfg.data.tokenizer = "char"
    cfg.train.seq_len = SEQ_LEN
    torch.manual_seed(seed)
    save_model(LanguageModel(cfg.model).eval(), tmp_path / "ckpt", cfg, tok)
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), AutoTokenizer.from_pretrained(tmp_path / "hf")


@pytest.mark.parametrize("kind,name,raw", list(generate_cases()))
def test_left_padded_generate_of_an_exported_model_equals_each_prompt_alone(kind, name, raw, tmp_path):
    model, tok = exported(tmp_path, kind, name, raw)
    batch = tok(PROMPTS, padding=True, return_tensors="pt")
    assert tok.padding_side == "left" and not bool(batch["attention_mask"].all())
    width = batch["input_ids"].shape[1]
    kw = dict(max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        together = model.generate(**batch, **kw)
        for b, prompt in enumerate(PROMPTS):
            enc = tok(prompt, return_tensors="pt")
            alone = model.generate(**enc, **kw)
            new = alone.sequences[0, enc["input_ids"].shape[1]:]
            assert together.sequences[b, width:].tolist() == new.tolist(), f"prompt {prompt!r}"
            for step, (s_batch, s_alone) in enumerate(zip(together.scores, alone.scores)):
                torch.testing.assert_close(s_batch[b], s_alone[0], rtol=0, atol=1e-4,
                                           msg=lambda m: f"prompt {prompt!r}, step {step}: {m}")


@pytest.mark.parametrize("kind,name", [("mixer", "attention"), ("mixer", "fast_rnn"), ("memory", "fwmlp")])
def test_left_padded_beam_search_equals_each_prompt_alone(kind, name, tmp_path):
    """Beam search reorders the padded state along the batch (a KV cache with its key mask and per-row
    positions, a folded fast matrix, a per-sequence memory's row states)."""
    case = next(c for c in generate_cases() if c.values[:2] == (kind, name))
    model, tok = exported(tmp_path, *case.values)
    batch = tok(PROMPTS, padding=True, return_tensors="pt")
    width = batch["input_ids"].shape[1]
    kw = dict(max_new_tokens=3 * NEW, do_sample=False, num_beams=3)
    with torch.no_grad():
        together = model.generate(**batch, **kw)
        for b, prompt in enumerate(PROMPTS):
            enc = tok(prompt, return_tensors="pt")
            alone = model.generate(**enc, **kw)[0, enc["input_ids"].shape[1]:]
            assert together[b, width:].tolist() == alone.tolist(), f"prompt {prompt!r}"


def test_a_text_generation_pipeline_batches_prompts_of_different_lengths(tmp_path):
    from transformers import pipeline

    model, tok = exported(tmp_path, "mixer", "gdn", {"chunk_size": 4, "backend": "torch"})
    gen = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    kw = dict(max_new_tokens=NEW, do_sample=False, return_full_text=False)
    one_by_one = [gen(p, **kw)[0]["generated_text"] for p in PROMPTS]
    batched = [r[0]["generated_text"] for r in gen(PROMPTS, batch_size=3, **kw)]
    assert batched == one_by_one
