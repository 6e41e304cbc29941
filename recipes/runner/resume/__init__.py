"""Which run a start continues, from which checkpoint, with which keys: decided once, by
``plan.plan_resume`` (the rules are its docstring)."""
