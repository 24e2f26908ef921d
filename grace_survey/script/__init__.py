"""Script mode: the API a user's training script imports, and the supervisor that runs it once per cell."""
