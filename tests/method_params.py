"""Parameters that make each method do real work on the tests' small tensors (methods not
listed run with their defaults). Shared by the multi-rank tests and tests/hvd_worker.py."""

PARAMS = {
    "topk": {"compress_ratio": 0.3},
    "randomk": {"compress_ratio": 0.3},
    "threshold": {"threshold": 0.8},
    "dgc": {"compress_ratio": 0.3, "min_compress_size": 1},
    "twobit": {"threshold": 0.5},
    "chunk_topk": {"chunk": 8, "k": 3},
}
