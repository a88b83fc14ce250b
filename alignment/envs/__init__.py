"""Environments for multi-turn rollouts, their tools and the tool-call format."""
