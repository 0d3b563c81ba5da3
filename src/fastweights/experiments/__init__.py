"""Experiments on language models, one module each: long-context evaluation of a trained model (its commands are in
:mod:`fastweights.cli`) and the comparisons the benchmarks in ``benchmarks/`` run.

* :mod:`fastweights.experiments.streaming` -- streaming perplexity along documents (``eval --stream``):
  carry / reset / frozen / memory modes, per-position curves in constant memory;
* :mod:`fastweights.experiments.fwpkm_gates` -- the FwPKM gate of every token of a text (``inspect gates``);
* :mod:`fastweights.experiments.fwl_comparison` -- an FWL head on a pretrained model against dynamic evaluation of
  the same model: the texts, the rows, settings chosen on tuning text, the gain split (the FWL benchmarks'), and
  in-domain training text for each scored text (:mod:`fastweights.experiments.in_domain_text`);
* :mod:`fastweights.experiments.leaderboard` -- the equal-compute leaderboard of every mechanism: its entries, the
  held-out plays it scores, the table of finished rows and its figure;
* :mod:`fastweights.experiments.fla_comparison` -- our delta-rule op, layers and models beside
  flash-linear-attention's and lucidrains' FwPKM: what the GPU comparisons build, time and check against;
* :mod:`fastweights.experiments.fwpkm_documents` -- FwPKM along long documents: the loss early and late in each,
  the slots each memory read;
* :mod:`fastweights.experiments.fast_rnn_read` -- the fast-weights RNN's memory read against its input term.

Continual adaptation across domains (``fastweights continual``) is :mod:`fastweights.adapt.continual`.

The memory switches they share with the tasks (``fastweights.tasks.niah``) live one floor down, in
:mod:`fastweights.models.memory_switches`.
"""
