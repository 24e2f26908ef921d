"""Projection of a survey's measurements onto larger clusters (``grace-dgc project``):
:mod:`.model` (the α-β cost model), :mod:`.methods` (what it projects: a survey's measured
methods, or methods built from assumptions) and :mod:`.project` (the command, its tables and
plot; its docstring states the formulas)."""
