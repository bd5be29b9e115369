"""Per-family adapters for ``qserve.model.registry`` (config translation + checkpoint name map)."""
