"""Projection of a survey's measurements onto larger clusters (``grace-dgc project``)."""
