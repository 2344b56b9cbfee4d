"""The one exception type user-facing code raises for bad input; the CLI maps it to exit code 2."""


class MlxspecError(ValueError):
    """Bad input or an unusable model: the message says what is wrong and what to do."""
