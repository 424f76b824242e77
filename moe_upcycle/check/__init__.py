"""Checks of a built MoE: verify against the dense base, logit comparison, init drift, routing."""
