"""Root error of the coordinator package."""


class CoordinatorError(RuntimeError):
    """The coordinator cannot go on; the message says what must hold and what was found."""
