"""Checkpoints: their files, manifests, layouts, folders, verified ranged reads and resharding loads."""
