"""Input-channel permutations: the soft-permutation core shared by prune and dst (``core``), the swap
search (``search``), learning (``learning``), per-block and whole-model learning for pruning
(``pruning``) and the index-mapped linear of a ``--perm`` checkpoint (``linear``)."""
