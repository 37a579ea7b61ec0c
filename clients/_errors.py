"""Root errors of the clients package."""


class ClientError(ValueError):
    """A client-side setting, data file or message broke a rule; the message says which."""


class ConfigError(ClientError):
    """A configuration value is invalid: names the key, what must hold and what was found."""
