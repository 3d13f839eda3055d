"""The plan's checks of one feature each (LoRA, preference, packed documents, GPU, launch, expert
parallelism): each refuses what its feature cannot run, in one line naming the config key, before
anything is built (recipe/plan.py calls them)."""
