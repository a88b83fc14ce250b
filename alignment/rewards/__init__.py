"""Rewards that run code: the sandbox (:mod:`alignment.rewards.sandbox`)."""
