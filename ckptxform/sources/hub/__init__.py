"""Hugging Face Hub sources: only the bytes a conversion needs, by ranges, through the real client."""
