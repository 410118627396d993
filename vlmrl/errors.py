"""The errors that cross module borders. `ConfigError` is here, below every other module, so that the config layer
and the registries (`vlmrl.registry`) can raise it without importing each other."""


class ConfigError(ValueError):
    """A config that cannot be composed or validated; the message is one line naming the key or value."""
