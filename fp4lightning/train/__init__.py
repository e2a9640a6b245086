"""Pretraining a LLaMA from a recipe: the recipe schema, the LightningModule, the run itself (build and fit:
run; start or resume: resume; its callbacks; its logs: loss_log), checkpoints, starting from existing weights,
throughput."""
