"""Environments users already have, each in its own interpreter: worker processes the buffer starts and drives."""
