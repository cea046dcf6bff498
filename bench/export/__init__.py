"""Benches of the export's products: int8 graphs, and the published-model chain (import, export, serve, embed)."""
