"""What the sections measure: the training loops compared (``loops``: ours, by hand, Ignite,
Lightning; ``airbench94``: airbench's own code), the workloads they train (``workloads``)
and the recipes' handler set on a benchmark's trainer (``recipe_handlers``)."""
