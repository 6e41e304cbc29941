"""``python -m benchmarks`` (``make bench``): engine overhead against a hand-written loop,
Ignite and Lightning (``overhead``), host syncs per iteration (``syncs``), data pipeline
throughput (``data``) and CIFAR-10 epoch time (``epoch``), written to docs/benchmarks.md."""
