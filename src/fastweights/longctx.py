"""Old import path of the long-context code, kept working: ``from fastweights.longctx import NAME``.

The code lives by what it is (issue 20); new code imports it from there:

* :mod:`fastweights.memory_switches` -- the memories' switches and the reading primitive the tasks and
  experiments share: ``fast_memories``, ``unfrozen_fast_parts``, ``memory_writes``, ``memory_only_state``,
  ``check_chunk_empty``, ``read_tokens``;
* :mod:`fastweights.experiments.streaming` -- streaming perplexity: ``STREAM_MODES``, ``stream_eval``,
  ``StreamResult``, ``PositionCurve``, ``encode_documents``, ``current_rss_mb``, ``peak_rss_mb``, ``plot_stream``;
* :mod:`fastweights.experiments.continual_adaptation` -- continual adaptation: ``Domain``, ``make_domain``,
  ``adapt_test``, ``format_adapt_table``, ``plot_adapt``;
* :mod:`fastweights.experiments.fwpkm_gates` -- the FwPKM gate map: ``gate_values``, ``plot_gate_map``.

This module re-exports those names (``fastweights.tasks.niah``, ``fastweights.tasks.niah_token``,
benchmarks and user code import them from here).
"""

from __future__ import annotations

from fastweights.experiments.continual_adaptation import Domain, adapt_test, format_adapt_table, make_domain, plot_adapt
from fastweights.experiments.fwpkm_gates import gate_values, plot_gate_map
from fastweights.experiments.streaming import (STREAM_MODES, PositionCurve, StreamResult, current_rss_mb,
                                               encode_documents, peak_rss_mb, plot_stream, stream_eval)
from fastweights.memory_switches import (check_chunk_empty, fast_memories, memory_only_state, memory_writes,
                                         read_tokens, unfrozen_fast_parts)

__all__ = ["STREAM_MODES", "Domain", "PositionCurve", "StreamResult", "adapt_test", "check_chunk_empty",
           "current_rss_mb", "encode_documents", "fast_memories", "format_adapt_table", "gate_values", "make_domain",
           "memory_only_state", "memory_writes", "peak_rss_mb", "plot_adapt", "plot_gate_map", "plot_stream",
           "read_tokens", "stream_eval", "unfrozen_fast_parts"]
