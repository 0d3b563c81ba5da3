"""Peak RSS of `fastweights prepare` on a ~100 MB text file, and of training from the result.

    python benchmarks/speed/prepare_rss.py [--mb 100] [--tokenizer gpt2] [--data tinyshakespeare]

The ~100 MB file is the text of ``--data`` (a registered corpus, default ``tinyshakespeare``) repeated.

Each step runs in its own process; its peak resident set size comes from getrusage. Writes
benchmarks/results/prepare_rss.json. The point: RAM stays bounded (far below the corpus
size times the 8 bytes an int64 token list would take) because text is encoded piece by piece
into a memory-mapped file, and training samples windows from the memory map.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from fastweights.evidence.result_files import write_result
from fastweights.cli.script_parser import ScriptParser, exit_status_of
from fastweights.evidence.timing import call_seconds

from fastweights.data import load_corpus, to_utf8

DATA = "tinyshakespeare"


def run(cmd: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of a child process."""
    max_rss = []  # the children's peak RSS before and after the child

    def child():
        max_rss.append(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        max_rss.append(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)

    (seconds,) = call_seconds(child)
    before, peak = max_rss
    if peak <= before:
        raise RuntimeError("peak RSS of the child did not exceed an earlier child's; run steps in order of size")
    return seconds, peak / 1024


def probe_specs(probes) -> list[dict]:
    """The behaviour probes of the code this benchmark measures (see tools/probes.py)."""
    return [probes.probe("corpus", name="tinyshakespeare")]



def main():
    ap = ScriptParser()
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--tokenizer", default="gpt2")
    ap.add_argument("--data", default=DATA, help=f"registered corpus whose text is repeated (default {DATA})")
    a = ap.parse_args()
    text = b"".join(to_utf8(d.text) for d in load_corpus(a.data))  # the documents' UTF-8 bytes, in order
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "big.txt"
        with corpus.open("wb") as f:
            for _ in range(a.mb * 2**20 // len(text) + 1):
                f.write(text)
        size_mb = corpus.stat().st_size / 2**20
        py = sys.executable
        base_s, base_mb = run([py, "-c", "import fastweights.loops.train, torch"])
        prep_s, prep_mb = run([py, "-m", "fastweights", "prepare", "--data", str(corpus), "--tokenizer", a.tokenizer,
                               "--out", str(tmp / "prepared"), "--quiet"])
        train_s, train_mb = run([py, "-m", "fastweights", "train", "--preset", "tiny", "--data", str(tmp / "prepared"),
                                 "--out", str(tmp / "run"), "--quiet", "--set", "train.max_steps=5"])
        n_tokens = sum(f.stat().st_size for f in (tmp / "prepared").glob("*.bin"))
    res = {"data": a.data, "corpus_mb": size_mb, "tokenizer": a.tokenizer, "token_file_mb": n_tokens / 2**20,
           "peak_rss_mb": {"import_only": base_mb, "prepare": prep_mb, "train_5_steps_from_memmap": train_mb},
           "seconds": {"prepare": prep_s, "train_5_steps": train_s},
           "note": "peak RSS of separate child processes; import_only is the floor of Python + torch"}
    res["headline"] = [
        {"what": f"`fastweights prepare` on {size_mb:.0f} MB of text ({a.tokenizer}): peak RSS", "value": round(prep_mb),
         "unit": "MB", "target": "bounded (<< corpus x 8 B/token)"},
        {"what": f"training from the {size_mb:.0f} MB prepared corpus: peak RSS", "value": round(train_mb), "unit": "MB"},
    ]
    print(res)
    write_result("prepare_rss", res)


if __name__ == "__main__":
    sys.exit(exit_status_of(main))
