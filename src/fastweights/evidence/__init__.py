"""Evidence: what a stored result records so that a reader can tell whether it still measures the code.

* :mod:`fastweights.evidence.provenance` -- the command, date, commit and machine a result was made with;
* :mod:`fastweights.evidence.probes` -- behaviour probes: seconds-long fp64 runs of the code path a result
  measured, each reduced to a summary;
* :mod:`fastweights.evidence.summaries` -- those summaries, and their comparison with one tolerance;
* :mod:`fastweights.evidence.result_files` -- a benchmark's result file in the checkout's benchmarks/results/;
* :mod:`fastweights.evidence.timing` -- how a benchmark times a call (CPU or wall seconds, the median).

This floor sits just below the command line: probes build models, layers, evaluators and tasks from every
floor beneath it. ``benchmarks/tools/evidence.py`` decides with it which stored results are stale.
"""
