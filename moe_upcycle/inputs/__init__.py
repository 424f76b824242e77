"""Checks of hostile input shared by every stage: text (Unicode, UTF-8, token ids) and paths (symlink loops)."""
