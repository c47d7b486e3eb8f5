"""The model registry: registering versions, reading them, exporting adapters."""
