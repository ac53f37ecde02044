"""The error of a bad run-config key, in a module that imports nothing, so that tooling
can raise and catch it without loading the schema (:mod:`common.config`) and its
dependencies."""


class ConfigError(ValueError):
    """A run-config key has an invalid value; the message names key, value and fix."""
