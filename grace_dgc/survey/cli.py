"""Deprecated: ``python -m grace_survey.cli`` (kept for one release, see :mod:`grace_dgc.survey`)."""

import sys

from grace_survey.cli import *  # noqa: F403  (its names, under the old module)
from grace_survey.cli import main

if __name__ == "__main__":
    sys.exit(main())
