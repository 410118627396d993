"""The errors that cross module borders. `ConfigError` is here, below every other module, so that the config layer
and the registries (`vlmrl.registry`) can raise it without importing each other."""


class ConfigError(ValueError):
    """A config that cannot be composed or validated; the message is one line naming the key or value."""


class ShmRoomError(ConfigError):
    """The shm weight-sync route's two buffers do not fit in /dev/shm (a container's default is 64 MB); the message
    is one line naming the settings to change."""


class MemoryPlanError(ConfigError):
    """A run whose GPU memory plan (`vlmrl.train.memory_plan`) does not fit its GPU; the message is one line naming
    the phase, its peak, the GPU's memory and the knobs that lower it."""


def error_line(err: BaseException) -> str:
    """`err` as `Type: message` on one line (whitespace runs collapsed), at most 300 characters: how a failure that
    becomes data (a failed judgement, an excluded episode) names its cause."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]
