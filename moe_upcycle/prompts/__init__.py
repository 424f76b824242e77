"""Prompt-set intelligence: semantic lint, growing prompt sets, the sentence embedder."""
