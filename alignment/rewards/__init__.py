"""Rewards that run code: the sandbox (:mod:`alignment.sandbox.runner`)."""
