"""The one exception type the value-head module raises for bad user input."""


class CriticLoadError(ValueError):
    """A checkpoint, config or output path that cannot be used as asked; the message names the fix."""
