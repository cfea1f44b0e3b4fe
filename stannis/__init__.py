"""Stannis: data-parallel training across one host rank and many CSD ranks."""
