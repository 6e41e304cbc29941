"""The training run: the checks before anything is written, the run folder and its lock, the
resume plan, the processes, the standard handlers, the console lines and the summary."""
