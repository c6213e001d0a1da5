"""The project's error types.

Every problem a user can cause or fix (a bad file, a bad flag, no network) raises a `Qwen3Error`
subclass whose message is one line naming the file or flag and what to do. The CLI prints that
line and exits with code 2; anything else is a bug and keeps its traceback.
"""


class Qwen3Error(Exception):
    """Base class: a user-facing problem with a one-line, actionable message."""


class ConfigError(Qwen3Error):
    """config.json describes a model we do not implement, or contradicts itself."""


class CheckpointError(Qwen3Error):
    """A weight file is missing, truncated, corrupt, or does not match the config."""


class HubError(Qwen3Error):
    """Downloading from the Hugging Face Hub failed (no network, unknown or gated repo)."""


class GenerationError(Qwen3Error):
    """Bad generation settings: impossible sampling values, a prompt longer than the context."""


class InputError(Qwen3Error):
    """A prompt that cannot be used: unreadable, not UTF-8, or larger than the documented limits."""
