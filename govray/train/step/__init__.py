"""The governed step: what every worker does for one step, and the pieces it is built from."""
