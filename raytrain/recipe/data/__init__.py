"""Data: checking Parquet input, the embedded digits set, the Ray Data pipeline and `raytrain prepare`."""
