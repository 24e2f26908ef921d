"""The survey's report: grouping, statistics, the headline ranking, notes, tables, plots and the writer."""
