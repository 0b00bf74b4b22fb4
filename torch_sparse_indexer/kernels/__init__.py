"""GPU kernel backends. Each family registers itself with :mod:`torch_sparse_indexer.backends` when its
toolchain is importable; importing never compiles a kernel (``warmup()`` does, ahead of capture)."""
