"""Crash-safe checkpoints, one module a concern, each imported by its own name:

- ``checkpointer``: the ``Checkpointer`` handler: what is saved when, retention, what a run
  resumes from;
- ``formats``: the two formats and the one place that picks between them
  (``format_for(strategy)``, ``read_checkpoint(path)``);
- ``files``: checkpoint names, sidecars, commits and the single-file format (``.pt``);
- ``sharded``: the sharded format (``.dcp`` folders, every process writing its shards);
- ``dcp_metadata`` and ``untrusted``: reading a folder or file that may be hostile, bounded
  and without running code;
- ``crash_points``: kills a save at each phase of its commit (tests only).
"""
