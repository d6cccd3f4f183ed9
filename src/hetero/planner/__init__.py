"""The planner: host/device placement and the parallel strategy of a model, chosen from a cost
model measured on this machine under memory budgets (``hetero.plan``, ``hetero.apply``).

Modules: ``capture`` (a model's units and their costs, on fake tensors), ``calibration`` (this
machine's rates, measured once and cached), ``cost`` (a candidate's predicted step time and
bytes), ``search`` (dynamic programming, an exact ILP, brute force for checks; the outer
enumeration), ``plan`` (the plan value, its file and report), ``apply`` (a plan made real), ``optimizers`` (the dense optimizers where a plan keeps their state),
``meter`` (a step's measured device peak).
"""
