"""The sections of docs/benchmarks.md, one module each, named by its number there: each
measures (``measure``) and writes its markdown (``render``)."""
