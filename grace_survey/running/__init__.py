"""Running a survey: the grid driver, one cell from start to summary, training, tuning, the results files."""
