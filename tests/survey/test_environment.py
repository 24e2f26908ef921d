"""The survey's environment variables are its own (issue 55): listed in grace_survey.environment,
none of them in the library's list."""

from __future__ import annotations

from conftest import SURVEY_SOURCE, variables_read

from grace_dgc import environment
from grace_survey import environment as survey_environment


def test_every_variable_the_survey_reads_is_listed_by_the_library_or_the_survey():
    survey = variables_read(SURVEY_SOURCE) - set(environment.VARIABLES)
    assert survey - set(survey_environment.VARIABLES) == set(), "read but not listed in grace_survey.environment"
    assert set(survey_environment.VARIABLES) - survey == set(), "listed but no longer read"
    assert not set(survey_environment.VARIABLES) & set(environment.VARIABLES)
