"""mlx-lm adapters: the H2O cache, the true-query hook and the GGUF loader."""
