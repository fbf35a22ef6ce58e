"""DSA kernels: sparse attention over each query's selected keys (docs/dsa.md)."""
