"""A message-only Flower app (tests/flower_apps/noop/pyproject.toml)."""
