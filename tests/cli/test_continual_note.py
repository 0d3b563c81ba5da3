"""``fastweights continual`` on a model without memories (issue 49): without --dynamic and with the default
--eval-state memory nothing a stage reads reaches the scores; the table of zeros comes with a note saying why and
what to add, in the output and in the JSON; with --dynamic there is no note."""

import json

from fastweights.cli import main


def test_a_model_without_memories_gets_a_note_beside_its_zeros(tiny_run, tmp_path, capsys):
    doc = tmp_path / "a.txt"
    doc.write_text("To be, or not to be, that is the question. " * 60)
    base = ["continual", "--checkpoint", str(tiny_run), "--domain", f"a={doc}", "--domain", f"b={doc}",
            "--adapt-tokens", "200", "--eval-tokens", "100", "--quiet"]
    assert main([*base, "--out", str(tmp_path / "plain")]) == 0
    out = capsys.readouterr().out
    res = json.loads((tmp_path / "plain" / "adapt.json").read_text())
    assert "note: the model has no fast memory and --dynamic is not set" in out and "--dynamic RULE" in res["note"]
    assert res["note"] == ("the model has no fast memory and --dynamic is not set: with --eval-state memory nothing "
                           "read in a stage reaches the scores, so every change is 0 (add --dynamic RULE, or "
                           "--eval-state all)")
    assert len(res["delta"]) == 3 and all(v == 0.0 for row in res["delta"] for v in row)
    assert main([*base, "--out", str(tmp_path / "dyn"), "--dynamic", "sgd", "--lr", "1e-3"]) == 0
    assert "note:" not in capsys.readouterr().out
    assert "note" not in json.loads((tmp_path / "dyn" / "adapt.json").read_text())
