"""The recipe layer: what train.py, the dry run, generate.py and the benchmarks share.

    plan.py   RunPlan.from_config(cfg, world_size): everything the config decides, checked, nothing built
    data_plan.py  the data files of data.dataset_path or of each data.mixture source, checked, fingerprinted
    build.py  processes and meshes, model, data, optimizer, the step's setup, from a plan
    step.py   train_step; objectives/: what it computes (next_token, preference, grpo), frozen models
    dry_run.py  --job.dry_run: the plan and the model built on meta, a memory estimate, nothing written

Imports run one way: train.py -> recipe -> components, parallelisms, models, float8.
"""

# weft's objectives register themselves (recipe/objectives/): imported here, so the registry holds
# them before any plan chooses one
from weft.recipe.objectives import distillation, grpo, next_token, preference  # noqa: E402, F401
