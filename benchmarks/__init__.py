"""``python -m benchmarks`` (``make bench``) writes docs/benchmarks.md, one section a module:

- ``sections/``: ``s1_overhead`` (engine overhead against a hand-written loop, Ignite and
  Lightning), ``s2_syncs`` (host syncs per iteration), ``s3_data`` (data pipeline
  throughput), ``s4_epoch`` (CIFAR-10 epoch time), ``s5_gpu`` (the CIFAR recipe against
  airbench94, CUDA only), ``s6_image_folder`` (the image-folder data path);
- ``arms/``: what is measured: the training loops compared and the workloads they train;
- ``harness/``: how: timing, side-by-side rounds, the plan's sizes, the machine, the report;
- ``tools/``: measurements outside ``make bench`` (``versus``: a revision against the
  working tree; ``instructions``: instruction counts under callgrind).
"""
