"""The gRPC door: the ``elmo.v1.Embedder`` and ``elmo.v1.ModelAdmin`` servicers, the call gate and interceptors
(auth, observation, bounded shares), and the lenient request decoding. A thin adapter over service.core."""
