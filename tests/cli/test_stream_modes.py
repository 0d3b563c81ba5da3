"""eval --stream on one document: modes that cannot differ from carry there are marked as equal, with why,
in the table, the JSON and the plot's legend (issue 40: six lines of which three were hidden, no word why)."""

import json

from fastweights.cli import main


def test_modes_equal_to_carry_on_one_document_say_so(tiny_run, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 3)
    out = tmp_path / "stream"
    assert main(["eval", "--checkpoint", str(tiny_run), "--stream", "--data", str(doc), "--quiet",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    runs = {r["mode"]: r for r in json.loads((out / "stream.json").read_text())["runs"]}
    assert set(runs) == {"carry", "reset", "frozen"}
    assert "equals" not in runs["carry"]
    assert runs["reset"]["equals"] == "carry" and "one document" in runs["reset"]["why_equal"]
    assert runs["frozen"]["equals"] == "carry" and "no fast memory" in runs["frozen"]["why_equal"]
    assert runs["reset"]["label"].endswith("(= carry)")  # the legend says why the line lies under carry's
    assert printed.count("note: ") == 2 and "reset clears the state only between documents" in printed


def test_reset_differs_from_carry_across_documents(tiny_run, tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, text in enumerate(["First Citizen:\nBefore we proceed any further.\n" * 3,
                              "ROMEO:\nBut soft, what light through yonder window breaks.\n" * 3]):
        (docs / f"{i}.txt").write_text(text)
    out = tmp_path / "stream"
    assert main(["eval", "--checkpoint", str(tiny_run), "--stream", "--data", str(docs), "--quiet",
                 "--modes", "carry,reset", "--out", str(out)]) == 0
    runs = json.loads((out / "stream.json").read_text())["runs"]
    assert not any("equals" in r for r in runs)
