"""Evidence: what a stored result records about how it was made, and writing it.

* :mod:`fastweights.evidence.provenance` -- the command, date, commit (with a hash of the code it ran) and
  machine a result was made with; :func:`~fastweights.evidence.provenance.write_cli_result` writes a
  ``fastweights`` command's result file with them;
* :mod:`fastweights.evidence.result_files` -- a benchmark's result file in the checkout's benchmarks/results/;
* :mod:`fastweights.evidence.timing` -- how a benchmark times a call (CPU or wall seconds, the median);
* :mod:`fastweights.evidence.script_args` -- the flags the benchmark scripts spell alike (``--threads`` with its
  one default).

Nothing here runs behaviour probes, and ``import fastweights`` imports none: the probes that tell whether a
stored result still measures the code (fp64 runs of the code path it measured, their summaries and the one
tolerance), the stamping of a new result's probes and the report are the repository's tools
(``tools/probes.py``, ``summaries.py``, ``evidence.py``, ``report.py``), not the package's.
This floor sits below the command line, which writes result files with it; it imports only ``core``.
"""
