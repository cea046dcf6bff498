"""Benches of the spaCy component and listener."""
