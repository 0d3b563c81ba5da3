"""tools/first_hour.py (issue 49): the README's times come from timing ``make TARGET`` in a fresh clone,
idle and beside spinning processes; a failed command is recorded with its output and the script exits 1; bad
arguments are one line and exit 2."""

import subprocess

from helpers import benchmark_script, import_benchmark, run_script

from fastweights.cli.script_parser import exit_status_of

bench = import_benchmark("first_hour")


def tiny_repo(tmp_path, recipe: str):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "Makefile").write_text(f"test:\n\t{recipe}\n")
    for cmd in (["init", "-q"], ["add", "Makefile"],
                ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "m"]):
        subprocess.run(["git", *cmd], cwd=repo, check=True)
    return repo


def test_each_target_runs_in_a_fresh_clone_idle_and_busy(tmp_path, monkeypatch):
    """Idle, then beside two spinners alive until the command ends; the clones are removed. Mutation caught: the
    busy run's spinners never started (the load beside the command is the idle one)."""
    repo = tiny_repo(tmp_path, "@sleep 3")
    monkeypatch.setattr(bench, "ROOT", repo)
    work = tmp_path / "work"
    work.mkdir()
    written = {}
    monkeypatch.setattr(bench, "write_result", lambda name, payload: written.update({name: payload}))
    monkeypatch.setattr("sys.argv", ["first_hour.py", "--targets", "test", "--busy", "2", "--work", str(work)])
    assert bench.main() == 0
    runs = written["first_hour"]["runs"]
    assert [(r["target"], r["busy_processes"], r["busy_at_the_end"], r["exit_status"]) for r in runs] == [
        ("test", 0, 0, 0), ("test", 2, 2, 0)]
    assert all(r["wall_s"] >= 3 for r in runs)
    assert list(work.iterdir()) == []


def test_a_failing_command_is_recorded_and_the_script_exits_1(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "ROOT", tiny_repo(tmp_path, "@echo broken; exit 3"))
    written = {}
    monkeypatch.setattr(bench, "write_result", lambda name, payload: written.update({name: payload}))
    monkeypatch.setattr("sys.argv", ["first_hour.py", "--targets", "test", "--busy", "0", "--work", str(tmp_path)])
    assert bench.main() == 1
    (run,) = written["first_hour"]["runs"]
    assert run["exit_status"] != 0 and any("broken" in line for line in run["output_tail"])


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """The first case runs as ``python first_hour.py`` (``sys.exit(exit_status_of(main))``: the real process's exit
    status and stderr); the others call ``main`` in this process, through ``exit_status_of``, where nothing may be
    timed or written."""

    def never(*_a, **_kw):
        raise AssertionError("bad arguments ran a command or wrote a result")

    monkeypatch.setattr(bench, "run_make", never)
    monkeypatch.setattr(bench, "write_result", never)
    for i, args in enumerate((["--targets", "lint"], ["--busy", "-1"], ["--work", str(tmp_path / "missing")])):
        if i == 0:
            r = run_script(benchmark_script("first_hour"), *args)
            status, err = r.returncode, r.stderr
        else:
            capsys.readouterr()
            status = exit_status_of(lambda: bench.main(args))
            err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1
        assert err.startswith("error: "), err
