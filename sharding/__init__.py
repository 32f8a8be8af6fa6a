"""Layouts (stage pipeline, tensor parallel) and the live phase flip between them."""
