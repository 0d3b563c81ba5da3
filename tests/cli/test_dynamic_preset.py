"""Dynamic evaluation's settings are defined once (``adapt.setup.DynamicSettings``: default, help, parser) and the
recommended SmolLM2 setting ships as a preset (``configs/dynamic/smollm2-135m.toml``) that the command line
(``--preset``), the harness (``preset=``) and the docs read (issue 48)."""

import dataclasses
import json

import pytest

from fastweights.adapt import setup as adapt_setup
from fastweights.adapt.setup import DynamicSettings, dynamic_preset, dynamic_presets
from fastweights.cli import main, parse_command_line
from fastweights.cli.dynamic import dynamic_settings
from fastweights.core.errors import UserError
from helpers import BENCHMARKS

EVAL = ["dynamic", "eval", "--hf", "gpt2-dir"]


def test_the_smollm2_preset_is_the_setting_the_benchmark_chose():
    result = json.loads((BENCHMARKS / "results" / "smollm2_dynamic_eval.json").read_text())
    chosen = result["results"][result["chosen"]]
    stats = result["gradient_statistics"]
    assert dynamic_preset("smollm2-135m") == {
        "rule": chosen["rule"], "lr": chosen["lr"], "segment_len": chosen["segment_len"],
        "exclude_params": chosen["exclude"], "stats_batch_size": stats["batch_size"],
        "stats_batches": stats["batches"], "stats_seq_len": stats["seq_len"]}
    assert chosen["include"] is None and not chosen["lowrank"] and chosen["lr_schedule"] == "constant"


def test_a_preset_gives_the_flags_their_defaults_and_a_flag_given_wins():
    plain = dynamic_settings(parse_command_line(EVAL))
    assert plain == DynamicSettings()  # every flag's default is its field's
    preset = dynamic_settings(parse_command_line([*EVAL, "--preset", "smollm2-135m"]))
    assert preset == DynamicSettings(**dynamic_preset("smollm2-135m"))  # the unflagged stats_* fields too
    given = dynamic_settings(parse_command_line([*EVAL, "--lr", "1e-4", "--preset", "smollm2-135m",
                                                 "--segment-len", "32"]))
    assert (given.lr, given.segment_len, given.rule) == (1e-4, 32, "rms")  # before or after --preset


def test_dynamic_stats_takes_the_presets_statistics_batches():
    args = parse_command_line(["dynamic", "stats", "--hf", "gpt2-dir", "--preset", "smollm2-135m"])
    assert (args.batch_size, args.max_batches, args.segment_len, args.context) == (4, 16, 64, 0)
    args = parse_command_line(["dynamic", "stats", "--hf", "gpt2-dir", "--preset", "smollm2-135m",
                               "--batch-size", "2"])
    assert (args.batch_size, args.max_batches) == (2, 16)


def test_the_context_of_a_preset_is_the_commands_context(tmp_path, monkeypatch):
    (tmp_path / "long.toml").write_text("context = 2048\nrule = \"sgd\"\n")
    monkeypatch.setattr(adapt_setup, "_presets_dir", lambda: tmp_path)
    settings = dynamic_settings(parse_command_line([*EVAL, "--preset", "long"]))
    assert (settings.context, settings.rule) == (2048, "sgd")


SETTINGS = ", ".join(f.name for f in dataclasses.fields(DynamicSettings))  # what an unknown key's line lists


@pytest.mark.parametrize("text, needle", [
    ("lr = -1.0\n", "preset bad: lr = -1.0: must be a finite number >= 0, got -1.0"),
    ("lr = \"fast\"\n", "preset bad: lr = 'fast': expected a number, got 'fast'"),
    ("segment_len = 6.5\n", "preset bad: segment_len = 6.5: expected an integer, got '6.5'"),
    ("segment_len = \"64\"\n", "preset bad: segment_len = '64': got '64' (str); write segment_len = 64"),
    ("lr = true\n", "preset bad: lr = True: got true, a boolean"),
    ("learning_rate = 1e-3\n", f"preset bad: learning_rate is not a dynamic-evaluation setting ({SETTINGS})"),
    ("lr_schedule = \"sometimes\"\n", "preset bad: lr_schedule = 'sometimes': learning-rate schedule 'sometimes': use "
                                     "constant, warmup:W or rsqrt:S (W, S > 0 updates)"),
])
def test_a_bad_preset_is_one_line_naming_the_setting(text, needle, tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.toml").write_text(text)
    monkeypatch.setattr(adapt_setup, "_presets_dir", lambda: tmp_path)
    with pytest.raises(UserError) as raised:
        dynamic_preset("bad")
    assert str(raised.value) == needle, raised.value
    assert main([*EVAL, "--data", "x.txt", "--preset", "bad"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: " + needle]


def test_an_unknown_preset_names_the_shipped_ones(capsys):
    assert "smollm2-135m" in dynamic_presets()
    assert main([*EVAL, "--data", "x.txt", "--preset", "smollm2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: no dynamic-evaluation preset 'smollm2'; shipped: " + ", ".join(dynamic_presets())]


def test_every_flag_of_a_setting_is_generated_from_its_field():
    """The dynamic commands' flags of DynamicSettings' fields have the field's default and help (no copy)."""
    from fastweights.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices["dynamic"]._subparsers._group_actions[0].choices
    fields = {f.name: f for f in dataclasses.fields(DynamicSettings)}
    seen = set()
    for name, sub in commands.items():
        own = {"segment_len", "context"} if name == "stats" else set()  # dynamic stats' own: the statistics' protocol
        for action in sub._actions:
            dest = "context" if action.dest == "seq_len" else action.dest  # --context
            if dest in fields and dest not in own:
                f = fields[dest]
                assert action.default == f.default and action.help.startswith(f.metadata["help"]), (name, f.name)
                seen.add(f.name)
    assert seen >= {"rule", "context", "lr", "decay", "tuned", "no_tuned", "eps", "lr_schedule", "segment_len", "stats",
                    "params", "exclude_params", "sparse_units", "sparse_layer", "lowrank_rank", "lowrank_params"}


def test_eval_dynamic_rule_is_the_rule_evaluated():
    """``eval --dynamic RULE`` names the rule (there is no --rule there). Mutation caught: the flag's dest misread."""
    args = parse_command_line(["eval", "--checkpoint", "runs/x", "--dynamic", "sgd"])
    assert dynamic_settings(args).rule == "sgd"


def test_with_no_preset_shipped_the_message_says_none(tmp_path, monkeypatch):
    monkeypatch.setattr(adapt_setup, "_presets_dir", lambda: tmp_path)
    with pytest.raises(UserError) as raised:
        dynamic_preset("smollm2-135m")
    assert str(raised.value) == "no dynamic-evaluation preset 'smollm2-135m'; shipped: none"


def test_dynamic_stats_names_its_save_flag_when_refusing_the_file(tmp_path, capsys):
    """Checked before any model is read (mutation caught: the flag's name dropped from the message)."""
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    assert main(["dynamic", "stats", "--checkpoint", str(tmp_path / "nowhere"), "--save", str(taken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --save {taken} exists and was not written by this command")
    assert taken.read_text() == "mine"


def test_dynamic_stats_collects_with_the_context_given(tiny_run, tmp_path, monkeypatch):
    """``dynamic stats --context N``: the statistics' attention context is N, passed on to the collection (here a
    stand-in that records it), not the model's own."""
    import fastweights.cli.dynamic as dynamic_cli

    seen = {}

    def record(model, tok, cfg, settings, segment_len, context, *rest):
        seen["context"] = context
        raise SystemExit(0)  # nothing collected: only what the command hands over

    monkeypatch.setattr(dynamic_cli, "collect_stats", record)
    with pytest.raises(SystemExit):
        main(["dynamic", "stats", "--checkpoint", str(tiny_run), "--context", "48", "--save",
              str(tmp_path / "stats.safetensors"), "--quiet"])
    assert seen == {"context": 48}
    # without --context, a checkpoint's own training length (mutation caught, issue 49 seed 9: its config not
    # handed on, which read the checkpoint as a Hugging Face model's and took 1,024)
    import json

    with pytest.raises(SystemExit):
        main(["dynamic", "stats", "--checkpoint", str(tiny_run), "--save", str(tmp_path / "stats.safetensors"),
              "--quiet"])
    assert seen == {"context": json.loads((tiny_run / "config.json").read_text())["train"]["seq_len"]} != {"context": 1024}


def test_the_statistics_context_is_given_else_the_models_at_most_1024_for_a_hugging_face_model():
    from types import SimpleNamespace

    from fastweights.adapt.setup import HF_STATS_CONTEXT, stats_context

    hf, ours = SimpleNamespace(default_context=8192), SimpleNamespace(train=SimpleNamespace(seq_len=256))
    assert HF_STATS_CONTEXT == 1024
    assert stats_context(0, hf, None) == 1024 and stats_context(0, SimpleNamespace(default_context=512), None) == 512
    assert stats_context(0, None, ours) == 256 and stats_context(300, hf, None) == 300
    assert stats_context(0, SimpleNamespace(), None) == 1024  # a model that names no context of its own


def test_a_context_the_command_works_out_is_the_settings_context():
    """``continual`` and ``eval --stream`` pass the context they use (the checkpoint's, not a flag): it wins over
    ``--context``. Mutation caught (seed 18): the given context ignored, the flag's value taken."""
    args = parse_command_line([*EVAL, "--context", "64"])
    assert dynamic_settings(args).context == 64
    assert dynamic_settings(args, context=128).context == 128
    assert dynamic_settings(args, context=0).context == 0  # zero given is zero (no bound), not the flag's 64
