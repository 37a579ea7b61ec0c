"""Root error of the aggregation package."""


class AggregationError(ValueError):
    """An update, codec or aggregation setting broke a rule; the message says which."""
