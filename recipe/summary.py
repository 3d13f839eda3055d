"""The start-up lines a run (recipe/build.py) and its dry run (recipe/dry_run.py) both print."""

from __future__ import annotations

from weft.recipe.plan import RunPlan


def global_batch_line(plan: RunPlan) -> str:
    """The global batch of one step: local batch x accumulation x data-parallel ranks, in the
    objective's samples (preference pairs: two rows each) and tokens, and the sequence length."""
    t = plan.cfg.training
    rows = plan.tokens_per_step // t.seq_len
    samples = plan.objective.describe_rows(rows)
    return (f"global batch {t.local_batch_size} x {t.gradient_accumulation_steps} accumulation x {plan.dims.dp} dp "
            f"= {samples} = {plan.tokens_per_step:,} tokens per step (seq_len {t.seq_len})")
