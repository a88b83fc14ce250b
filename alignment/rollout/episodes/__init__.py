"""Episodes: multi-turn rollouts in an environment, their token bookkeeping, and a dataset's answers in place of sampled ones."""
