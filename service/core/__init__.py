"""The request core, shared by both doors: admission and the drain switch, the bounds every request is held to,
the version count a request holds for its whole life, the batcher that queues it, and the answers' sizes.

Doors (service.grpc, service.http) decode their wire format into an ``elmo.v1`` request and call
:class:`service.core.requests.RequestCore`'s public operations; nothing here knows gRPC or HTTP.
"""
