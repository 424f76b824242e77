"""Checkpoints on disk: lazy dense readers, the tensor-name table, the streaming writer, output folders."""
