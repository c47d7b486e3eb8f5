"""The Hugging Face example: a tiny Llama from transformers under a signed depth policy."""
