"""mlxgw: a prefix-cache-aware gateway for mlx-lm serving."""
