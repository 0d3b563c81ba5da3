"""One lm-evaluation-harness run of a task with every document's log-likelihood kept, so that a harness model's
scores can be held against the library's own on the same texts (``benchmarks/quality/smollm2_lm_eval.py``)."""

from __future__ import annotations

import time


def harness_run(model: str, model_args: dict, task_manager, task: str) -> dict:
    """One lm-eval run of ``task`` with ``model`` (a registered harness model) and its ``model_args``: the metrics,
    each document's text and log-likelihood in document order, the process CPU seconds."""
    from lm_eval.evaluator import simple_evaluate

    t0 = time.process_time()
    out = simple_evaluate(model=model, model_args=model_args, tasks=[task], log_samples=True, bootstrap_iters=0,
                          task_manager=task_manager)
    cpu = time.process_time() - t0
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    metrics = {k.split(",")[0]: v for k, v in out["results"][task].items() if k.endswith(",none")
               and "stderr" not in k}
    return {"metrics": metrics, "cpu_s": round(cpu, 1),
            "documents": [{"name": s["doc"]["name"], "text": s["doc"]["text"],
                           "loglikelihood": float(s["filtered_resps"][0])} for s in samples]}
