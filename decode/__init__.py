"""Decode worker: reservation of blocks and a state slot, state import, continuous batching."""
