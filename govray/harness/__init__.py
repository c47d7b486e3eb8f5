"""The user's contract: trials, and the context they run in."""
