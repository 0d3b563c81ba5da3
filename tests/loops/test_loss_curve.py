"""The run's loss curve (loops.train.plot_loss_curve): training and validation losses in bits per token against
step, read from metrics.jsonl; a null loss (not finite) and a line torn by a kill are left out."""

import json
import math

from fastweights.loops import train


def test_the_curve_draws_each_finite_training_and_validation_loss_in_bits(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(train, "save_figure", lambda fig, path, dpi, root: figures.append(fig))
    lines = [{"step": 1, "loss": 2 * math.log(2)}, {"step": 2, "loss": None}, {"step": 3, "loss": math.log(2)},
             {"step": 3, "val_loss": 0.5, "val_bits": 1.5}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 4, "lo')  # torn by a kill
    train.plot_loss_curve(metrics, tmp_path / "loss_curve.png")
    (fig,) = figures
    curves = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()}
    assert curves == {"train": ([1, 3], [2.0, 1.0]), "validation": ([3], [1.5])}
    assert fig.axes[0].get_ylabel() == "bits per token"
