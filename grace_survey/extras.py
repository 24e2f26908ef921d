"""The survey's optional dependencies (the ``survey`` extra), imported where they are used so
that the core package and its CLI never load them; a missing one is a one-line error naming
the extra to install."""

import importlib
from types import ModuleType

from grace_dgc.errors import GraceConfigError

INSTALL = "pip install 'grace_dgc[survey]'"


def require(module: str, needed_for: str) -> ModuleType:
    """``import module`` (e.g. ``"scipy.stats"``), or a :class:`GraceConfigError` saying that
    it is needed for ``needed_for`` and how to install the survey extra."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".", 1)[0]
        raise GraceConfigError(
            f"{package} is not installed ({error}), needed for {needed_for}; install the survey extra: {INSTALL}"
        ) from None
