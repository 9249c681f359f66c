"""NanoFlow auto-search (NanoFlow section 3.3): an op profiler, a two-stage MILP, and plans in today's format.

profile.py   the profile file (what was measured, where) and its checks
profiler.py  the measurements (subjects.py: what is measured: the Llama layer, or any annotated layer)
costs.py     the cost model of one batch class, read from a profile
stage1.py    nano-batches, split/merged ops, side-by-side pairs and their order (MILP)
stage2.py    resource shares of the ops that run side by side (MILP over the profiled share grid)
emit.py      a structure as a plan (nfjax/schedule/plan.py) and a plan's modelled time
search.py    one plan per batch class, or Sequential
`nfjax autosearch profile|search` (nfjax/commands/autosearch.py) runs them; docs/design.md section 10.
"""
