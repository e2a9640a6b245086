"""Experiments on top of training: ``fp4lightning compare`` (variants x seeds), OCC and format fidelity on
real activations, and the DGE probe (docs/results.md)."""
