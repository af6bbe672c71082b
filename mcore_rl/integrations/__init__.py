"""Adapters that plug mcore_rl into other people's trainers (each the only place importing its trainer)."""
