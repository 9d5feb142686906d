"""Building blocks shared by every model family: a family file composes these, the engine never sees them."""
