"""The comparative survey: workloads, runner, metrics and reports (``grace-dgc survey``)."""
