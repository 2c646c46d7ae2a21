"""Where a run happens and how it is measured, one job per module.

- :mod:`.devices`: ``--device`` checked and resolved; TF32 for float32 matmuls.
- :mod:`.determinism`: seeds, PyTorch's deterministic algorithms, one thread for CPU factorizations.
- :mod:`.memory`: bytes held, whether a model fits, a run's peak memory.
- :mod:`.graph_pools`: what a layer keeps, allocated outside CUDA graphs' memory pools.
- :mod:`.faults`: GPU errors a candidate kernel is skipped for, and those that end the process.
- :mod:`.timing`: GPU time per call, replayed from a CUDA graph or launched eagerly.
- :mod:`.facts`: versions, CPU and GPU, as result files record them.
"""
