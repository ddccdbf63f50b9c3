"""Thin framework adapters: hooks in, observations out, decisions back."""
