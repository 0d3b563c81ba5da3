"""A model loaded by what its source is, in the spirit of transformers' Auto classes: :mod:`fastweights.auto.sources`
(nothing is imported here, so that the package loads without the optional ``transformers``)."""
