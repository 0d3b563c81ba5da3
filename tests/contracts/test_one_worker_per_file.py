"""``make test`` keeps each test file in one xdist worker (``--dist loadfile``): under plain load balancing both
workers built a module's fixtures (the documented harness commands, the GPU queue's dry run: each setup appeared
twice in the slowest durations), paying their minutes twice. (``--dist loadgroup`` with an ``xdist_group`` mark was
tried first: pytest-xdist 3.8 renames a grouped test through ``Item._nodeid``, which pytest 9 no longer reads, so
nothing was grouped: pytest-dev/pytest-xdist#1386, open.)"""

from pathlib import Path


def test_make_test_keeps_each_file_in_one_worker():
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "-n auto" in recipe and "--dist loadfile" in recipe
