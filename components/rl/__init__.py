"""Online RL with verifiable rewards, the parts recipe/objectives/grpo.py composes: the reward
functions (rewards.py: loading, calling, checking; builtin_rewards.py), the advantages and the GRPO
family's per-token loss (grpo.py, TRL 1.16's definitions), and rollouts.jsonl (rollouts.py)."""
