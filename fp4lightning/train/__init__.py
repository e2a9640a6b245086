"""Pretraining a LLaMA from a recipe: the recipe schema, the LightningModule, the run itself (build, fit,
resume checks, callbacks, the loss log), checkpoints, starting from existing weights, throughput."""
