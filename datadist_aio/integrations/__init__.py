"""Adapters that plug datadist_aio into serving frameworks, built on the public API only."""
