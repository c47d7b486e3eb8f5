"""One worker's whole run: the loop, where it runs (the session), its state, its reports."""
