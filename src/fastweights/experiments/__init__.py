"""Long-context experiments on a trained language model, one module each (their commands are in
:mod:`fastweights.cli`).

* :mod:`fastweights.experiments.streaming` -- streaming perplexity along documents (``eval --stream``):
  carry / reset / frozen / memory modes, per-position curves in constant memory;
* :mod:`fastweights.experiments.fwpkm_gates` -- the FwPKM gate of every token of a text (``inspect gates``).

Continual adaptation across domains (``fastweights continual``) is :mod:`fastweights.adapt.continual`.

The memory switches they share with the tasks (``fastweights.tasks.niah``) live one floor down, in
:mod:`fastweights.models.memory_switches`.
"""
