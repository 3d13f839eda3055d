"""weft: PyTorch-native, composable transforms for training Llama models at any scale.

The repository root is this package (pyproject.toml maps `weft` to it), so every folder at the
top is importable under one root: `weft.parallelisms` (apply_fsdp, apply_tp, ...),
`weft.models`, `weft.float8`, `weft.components`, `weft.recipe`, and the entry points
`weft.train` and `weft.generate`.
"""
