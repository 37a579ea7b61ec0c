"""Root error of the privacy package."""


class PrivacyError(ValueError):
    """A privacy or transport-security rule broke; the message says what weakens."""
