"""Import opacus without letting it reconfigure logging.

``opacus.utils.module_utils`` calls ``logging.basicConfig`` at import, which adds
a root handler and makes every log line of the run print twice.
"""

from __future__ import annotations

import logging


def quiet_import_opacus() -> None:
    """Import opacus once, then drop any root handler its import added."""
    root = logging.getLogger()
    before = list(root.handlers)
    import opacus  # noqa: F401
    import opacus.utils.module_utils  # noqa: F401

    for handler in root.handlers[:]:
        if handler not in before:
            root.removeHandler(handler)
