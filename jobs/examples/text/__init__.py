"""The text example: a character-level transformer on standard-library docstrings and fake records."""
