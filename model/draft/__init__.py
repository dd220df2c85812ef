"""Speculative decoding's drafters, loaded from a checkpoint directory beside the target's: `config.py` (what a
drafter's config.json says it is, checked against its target), `eagle.py` (one decoder layer over the target's
hidden state and the embedding of the token), `dspark.py` (one forward proposing a block of K tokens from the
target's hidden states of chosen layers), `loader.py` (a drafter on a device, bound to its target's embedding and
lm_head; a `draft_model` is a K3 model of its own, loaded as a target is), `checkpoint.py` (a random drafter for a
given target). Design: docs/design/spec_decode.md."""
