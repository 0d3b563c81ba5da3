"""Long-context experiments on a trained language model, one module each, with their commands.

* :mod:`fastweights.experiments.streaming` -- streaming perplexity along documents (``stream-eval``,
  ``eval --stream``): carry / reset / frozen / memory modes, per-position curves in constant memory;
* :mod:`fastweights.experiments.continual_adaptation` -- continual adaptation across domains (``adapt-test``);
* :mod:`fastweights.experiments.fwpkm_gates` -- the FwPKM gate of every token of a text (``fwpkm-gates``);
* :mod:`fastweights.experiments.cli` -- the commands ``niah``, ``stream-eval``, ``adapt-test``, ``fwpkm-gates``.

The memory switches they share with the tasks (``fastweights.tasks.niah``) live one floor down, in
:mod:`fastweights.memory_switches`.
"""
