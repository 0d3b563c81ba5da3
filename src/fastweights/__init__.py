"""fastweights: language models whose weights change with the text they read.

The library follows one protocol everywhere (see DESIGN in the docs):

    y, state = layer(x, state=None)

``state=None`` means a fresh sequence; the returned state continues exactly where the call
stopped, so one long call equals many short calls with the state carried.
"""

__version__ = "0.1.0"

from fastweights.core.errors import UserError  # noqa: F401
