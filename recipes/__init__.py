"""Recipes: the entry points (train, transcribe, benchmark) and the task-specific parts."""
