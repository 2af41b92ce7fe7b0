"""Facades: other frameworks' loss-scaling APIs as translation tables onto the lossscale core."""
