"""Deprecated: ``python -m grace_survey.running.runner`` (kept for one release, see :mod:`grace_dgc.survey`)."""

import sys

from grace_survey.running.runner import *  # noqa: F403  (its names, under the old module)
from grace_survey.running.runner import main

if __name__ == "__main__":
    sys.exit(main())
