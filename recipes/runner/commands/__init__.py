"""The commands next to training (``evaluate``, ``export``, ``consolidate`` and a recipe's own):
each starts from a trained run or one of its checkpoints."""
