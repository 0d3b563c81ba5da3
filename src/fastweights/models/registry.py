"""Old home of the component registry, kept so existing imports keep working.

The registry and the component contract live in :mod:`fastweights.components` (the ground floor, so
that ``layers/`` need not import ``models/``). ``from fastweights.models.registry import register_mixer``
and the other names below still work and mean the same objects.
"""

from fastweights.components import (  # noqa: F401  (re-exported names)
    HEADS,
    MEMORIES,
    MIXERS,
    Entry,
    build_options,
    load_providers,
    lookup,
    register_head,
    register_memory,
    register_mixer,
)
