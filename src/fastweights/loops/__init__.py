"""The loops over a model: training, scoring, generation."""
