"""Deployable services built on the pdserve library."""
