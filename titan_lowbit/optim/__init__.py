"""Optimizer front end: formats, AdamW math, param groups, DTensor handling."""
