"""weft: PyTorch-native, composable training for LLMs at any scale: four families in the repository
(Llama, Llama 4, Qwen3, gpt-oss) and any causal LM through transformers' own modeling code;
pretraining, SFT, LoRA/QLoRA and preference tuning.

The repository root is this package (pyproject.toml maps `weft` to it), so every folder at the
top is importable under one root: `weft.parallelisms` (apply_fsdp, apply_tp, ...),
`weft.models`, `weft.float8`, `weft.components`, `weft.recipe`, and the entry points
`weft.train` and `weft.generate`.
"""
