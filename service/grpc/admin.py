"""The ``elmo.v1.ModelAdmin`` servicer: explicit control of a model repository (service.models.versions) over gRPC.

Served only with ``--model-root`` and ``--admin-token``; every call must carry ``authorization: Bearer <admin
token>`` (:func:`admin_auth_interceptor`): none is UNAUTHENTICATED, another token (a client's) PERMISSION_DENIED.
"""

from __future__ import annotations

import grpc
import grpc.aio
from elmo.service.common.tokens import AdminToken
from elmo.service.grpc.decode import lenient_parser
from elmo.service.grpc.interceptors import AuthInterceptor
from elmo.service.grpc.servicer import _answer
from elmo.service.models.versions import ModelManager

from elmo.v1 import embedder_pb2 as pb

ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ModelAdmin"].full_name  # "elmo.v1.ModelAdmin"
ADMIN_PREFIX = f"/{ADMIN_SERVICE_NAME}/"


def admin_auth_interceptor(token: str) -> AuthInterceptor:
    """The admin token on ``elmo.v1.ModelAdmin`` calls (and only there)."""
    return AuthInterceptor(AdminToken(token), only_prefixes=(ADMIN_PREFIX,))


class ModelAdminServicer:
    def __init__(self, manager: ModelManager):
        self.manager = manager

    @_answer
    async def LoadModel(self, request, context):  # noqa: N802 - gRPC method names
        return await self.manager.load(request.name, int(request.version))

    @_answer
    async def UnloadModel(self, request, context):  # noqa: N802
        return await self.manager.unload(request.name, int(request.version))

    @_answer
    async def RepositoryIndex(self, request, context):  # noqa: N802
        return pb.RepositoryIndexResponse(models=self.manager.index())


def admin_handler(servicer: ModelAdminServicer) -> grpc.GenericRpcHandler:
    methods = {
        "LoadModel": (pb.LoadModelRequest, pb.ModelStatus),
        "UnloadModel": (pb.UnloadModelRequest, pb.ModelStatus),
        "RepositoryIndex": (pb.RepositoryIndexRequest, pb.RepositoryIndexResponse),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=lenient_parser(request),
            response_serializer=response.SerializeToString,
        )
        for name, (request, response) in methods.items()
    }
    return grpc.method_handlers_generic_handler(ADMIN_SERVICE_NAME, handlers)


__all__ = ["ADMIN_PREFIX", "ADMIN_SERVICE_NAME", "ModelAdminServicer", "admin_auth_interceptor", "admin_handler"]
