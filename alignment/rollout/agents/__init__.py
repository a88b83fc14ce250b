"""Agent programs as rollouts: your own agents (programs), the OpenAI-compatible rollout server they play against (server), and each episode's token record (session)."""
