"""Environments served by OpenEnv, reached by URL (`env=openenv env.url=...`)."""
