"""The recipe: the YAML schema, named prompt sets, calibration text, and the parameters each stage gets."""
