"""OpRAG benchmarks. Run each as a module from the repository root, e.g.
``python -m bench.retrieval --quick`` (see bench/RESULTS.md)."""
