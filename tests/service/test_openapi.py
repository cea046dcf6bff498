"""GET /openapi.json is valid OpenAPI 3.1 (openapi-spec-validator) and describes what the server serves: every route
and method, every error status with the JSON error shape, the bearer scheme, the page as HTML, examples that are
valid requests. tests/service/test_fuzz.py checks the real answers against it."""

from __future__ import annotations

import copy
import json
import shutil
import urllib.request

import pytest
from elmo.service.common.errors import Kind
from elmo.service.http.app import ADMIN_PATH, OPEN_PATHS
from elmo.service.http.openapi import openapi_document
from elmo.service.server import RepositoryOptions
from openapi_schema_validator import OAS31Validator
from openapi_spec_validator import OpenAPIV31SpecValidator
from referencing import Registry, Resource
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012

from elmo.runtime import Embedder
from elmo.v1 import embedder_pb2 as pb
from tests.service_helpers import EDGE_LIMITS, ServerThread

# as served (JSON, not Python tuples) by a server with every part on: the admin API and a clients' token
DOCUMENT = json.loads(json.dumps(openapi_document(admin=True, bearer=True)))
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def spec_errors(document: dict) -> list[str]:
    """What openapi-spec-validator finds wrong (a $ref to nowhere raises instead of yielding: reported too)."""
    try:
        return [error.message for error in OpenAPIV31SpecValidator(document).iter_errors()]
    except Unresolvable as exc:
        return [f"unresolvable reference: {exc}"]


def operations(document: dict):
    for path, item in document["paths"].items():
        for method in METHODS:
            if method in item:
                yield path, method, item[method]


def deref(document: dict, node: dict) -> dict:
    """A response object, following a local $ref."""
    while "$ref" in node:
        target = document
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def test_the_document_is_valid_openapi_3_1():
    assert spec_errors(DOCUMENT) == []
    assert DOCUMENT["openapi"].startswith("3.1.")


def _drop_description(doc):  # the original fault: 200 responses without a description
    del doc["paths"]["/v1/embed"]["post"]["responses"]["200"]["description"]


def _dangling_ref(doc):
    doc["paths"]["/v1/embed"]["post"]["responses"]["200"]["content"]["application/json"]["schema"] = {
        "$ref": "#/components/schemas/Nope"
    }


def _undeclared_path_parameter(doc):
    del doc["paths"]["/v1/models/{model_id}"]["parameters"]


def _bad_schema_type(doc):
    doc["components"]["schemas"]["Health"]["properties"]["status"] = {"type": "strin"}


def _unknown_keyword(doc):
    doc["paths"]["/"]["get"]["responses"]["200"]["content"]["text/html"]["exampel"] = "<html>"


def _no_paths_and_wrong_version(doc):
    doc["openapi"] = "3.1"
    del doc["paths"]


BREAKAGES = [
    _drop_description,
    _dangling_ref,
    _undeclared_path_parameter,
    _bad_schema_type,
    _unknown_keyword,
    _no_paths_and_wrong_version,
]


@pytest.mark.parametrize("breakage", BREAKAGES, ids=[b.__name__.strip("_") for b in BREAKAGES])
def test_the_validator_rejects_a_broken_copy(breakage):
    """The check above can fail: each broken copy of the document is rejected."""
    broken = copy.deepcopy(DOCUMENT)
    breakage(broken)
    assert spec_errors(broken) != []


@pytest.fixture(scope="module")
def routes(tiny_model_dir, tmp_path_factory):
    """(METHOD, path) of every route of a real server's HTTP app (HEAD: aiohttp's automatic twin of each GET): a
    model repository with the admin API, which adds the /admin/ routes."""
    root = tmp_path_factory.mktemp("openapi-repository")
    shutil.copytree(tiny_model_dir, root / "tiny" / "1")
    repository = RepositoryOptions(root, lambda d: Embedder(d, intra_op_threads=1))
    server = ServerThread({}, EDGE_LIMITS, http=True, repository=repository, admin_token="admin")
    try:
        app = server.server.http.app
        return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    finally:
        server.stop()


def test_every_route_and_method_is_documented_and_nothing_else(routes):
    assert {(method.upper(), path) for path, method, _ in operations(DOCUMENT)} == routes


def test_open_paths_need_no_token_and_every_other_route_the_bearer_scheme():
    schemes = DOCUMENT["components"]["securitySchemes"]
    assert schemes == {name: {**schemes[name], "type": "http", "scheme": "bearer"} for name in ("bearer", "admin")}
    assert DOCUMENT["security"] == [{"bearer": []}]
    for path, method, operation in operations(DOCUMENT):
        security = operation.get("security", DOCUMENT["security"])
        assert (security == []) == (path in OPEN_PATHS), (method, path)
        assert (security == [{"admin": []}]) == path.startswith(ADMIN_PATH), (method, path)  # the admin token alone
        if path not in OPEN_PATHS:
            responses = operation["responses"]
            assert "401" in responses and "WWW-Authenticate" in deref(DOCUMENT, responses["401"])["headers"]


def test_every_operation_lists_the_statuses_it_can_answer_with_the_error_shape():
    for path, method, operation in operations(DOCUMENT):
        statuses = set(operation["responses"])
        assert "default" not in statuses  # a catch-all would make every status "documented"
        expected = {"200", "500", "503"}  # 503: past --max-connections, any route
        if path not in OPEN_PATHS:
            expected |= {"401"}
        if method == "post":
            expected |= {"400", "404", "408", "413", "415"}  # bad JSON, unknown model, stalled, too large, not JSON
        if path in ("/v1/embeddings", "/v1/embed"):
            expected |= {"429", "504"}  # the queue: overloaded, deadline
        if path == "/v1/models/{model_id}":
            expected |= {"404"}
        if path.startswith(ADMIN_PATH):  # another token than the admin one: 403; a version refused: 409
            expected |= {"403", "409"} if method == "post" else {"403"}
        assert statuses == expected, (method, path)
        for status, response in operation["responses"].items():
            response = deref(DOCUMENT, response)
            assert response["description"], (method, path, status)
            if status == "200":
                media_type = "text/html" if path == "/" else "application/json"
                assert set(response["content"]) == {media_type}, (method, path)
            elif not (path == "/health" and status == "503"):  # health's 503 is NOT_SERVING (or the error shape)
                schema = response["content"]["application/json"]["schema"]
                assert schema["allOf"][0] == {"$ref": "#/components/schemas/Error"}, (method, path, status)
                assert schema["allOf"][1]["properties"]["error"]["properties"]["code"] == {"const": int(status)}


def _validator(name: str) -> OAS31Validator:
    """A JSON Schema validator (OpenAPI 3.1's dialect) for the document's schema ``name``, its $refs resolved in the
    document."""
    root = Resource.from_contents(DOCUMENT, default_specification=DRAFT202012)
    registry = Registry().with_resource("urn:openapi", root)
    return OAS31Validator({"$ref": f"urn:openapi#/components/schemas/{name}"}, registry=registry)


@pytest.mark.parametrize("name", ["EmbeddingsRequest", "EmbedRequest", "TokenizeRequest"])
def test_the_request_examples_are_valid_requests(name):
    examples = DOCUMENT["components"]["schemas"][name]["examples"]
    assert examples
    for example in examples:
        assert list(_validator(name).iter_errors(example)) == [], example
    assert list(_validator(name).iter_errors({"nothing": "useful"})) != []  # the validation can fail


def test_the_error_schema_is_the_shape_the_server_sends():
    documented = DOCUMENT["components"]["schemas"]["Error"]["properties"]["error"]["properties"]["type"]["examples"]
    assert {kind.value.replace(" ", "_") for kind in Kind} <= set(documented)  # every kind of error is named
    validator = _validator("Error")
    assert validator.is_valid({"error": {"message": "'input' is missing", "type": "invalid_input", "code": 400}})
    assert not validator.is_valid({"error": {"message": "x", "type": "invalid_input"}})
    assert not validator.is_valid({"detail": "x"})


REQUESTS = ("EmbeddingsRequest", "EmbedRequest", "TokenizeRequest")


@pytest.mark.parametrize("name", REQUESTS)
def test_every_request_takes_its_texts_as_input_and_marks_each_other_name_as_an_alias(name):
    """One name per idea: the texts are 'input' on every route; an older name still accepted is a deprecated alias
    of a field of the same request, never a second name with its own meaning."""
    properties = DOCUMENT["components"]["schemas"][name]["properties"]
    assert "input" in properties and not properties["input"].get("deprecated")
    for field, schema in properties.items():
        if schema.get("deprecated"):
            target = schema["description"].split("'")[1]
            assert schema["description"].startswith("alias of ") and target in properties, (name, field)
            assert not properties[target].get("deprecated"), (name, field)
    words = {field for field, schema in properties.items() if not schema.get("deprecated")}
    if name != "EmbeddingsRequest":  # (OpenAI's request keeps its 'user', which no other route has)
        assert words - {"input", "encoding_format"} <= PROTO_WORDS[name], name


PROTO_WORDS = {  # the proto's field names: the HTTP schema uses the same words
    "EmbedRequest": {f.name for f in pb.EmbedRequest.DESCRIPTOR.fields},
    "TokenizeRequest": {f.name for f in pb.TokenizeRequest.DESCRIPTOR.fields},
}


@pytest.mark.parametrize(
    "body, valid",
    [
        ({"input": ["x"], "layers": [2], "task": "t"}, True),
        ({"input": ["x"], "task": "t", "omit_layers": True}, True),
        ({"input": ["x"], "layers": [2], "task": "t", "omit_layers": True}, False),  # layers cannot take effect
        ({"input": ["x"], "inputs": ["x"]}, False),  # a field and its alias
        ({"inputs": ["x"], "encoding": "base64"}, True),  # aliases alone
        ({"input": ["x"], "encoding": "base64", "encoding_format": "float"}, False),
    ],
)
def test_the_embed_request_schema_refuses_what_the_server_refuses(body, valid):
    assert _validator("EmbedRequest").is_valid(body) is valid


@pytest.fixture(scope="module")
def plain_server(tiny_model_dir):
    """A server without the admin API (no --admin-token)."""
    server = ServerThread({"tiny": Embedder(tiny_model_dir, intra_op_threads=1)}, EDGE_LIMITS, http=True)
    yield server
    server.stop()


def test_a_server_without_the_admin_api_documents_only_the_routes_it_serves(plain_server):
    with urllib.request.urlopen(f"{plain_server.http_url}/openapi.json", timeout=30) as response:
        served = json.loads(response.read())
    app = plain_server.server.http.app
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert {(method.upper(), path) for path, method, _ in operations(served)} == routes
    assert not any(path.startswith(ADMIN_PATH) for path in served["paths"])
    assert spec_errors(served) == []
    assert served == json.loads(json.dumps(openapi_document(admin=False)))


@pytest.fixture(scope="module")
def token_server(tiny_model_dir):
    """A server with a clients' token (--auth-token), without the admin API."""
    model = {"tiny": Embedder(tiny_model_dir, intra_op_threads=1)}
    server = ServerThread(model, EDGE_LIMITS, auth_token="t", http=True)
    yield server
    server.stop()


def served_document(server) -> dict:
    with urllib.request.urlopen(f"{server.http_url}/openapi.json", timeout=30) as response:
        return json.loads(response.read())


def statuses_and_security(document: dict) -> tuple[set[str], set[str], list]:
    """Every status any operation answers, the security schemes, and the document's security requirement."""
    statuses = {status for _, _, operation in operations(document) for status in operation["responses"]}
    return statuses, set(document.get("components", {}).get("securitySchemes", {})), document.get("security", [])


def test_the_bearer_scheme_and_401_are_listed_only_where_the_server_has_a_token(plain_server, token_server):
    """A server started without --auth-token answers no 401 and asks for no token: its document says neither; with
    a token, every route but the open paths asks for it and can answer 401."""
    plain, with_token = served_document(plain_server), served_document(token_server)
    statuses, schemes, security = statuses_and_security(plain)
    assert "401" not in statuses and "Error401" not in plain["components"]["responses"]
    assert schemes == set() and security == []
    assert all("security" not in operation for _, _, operation in operations(plain))  # no token anywhere
    statuses, schemes, security = statuses_and_security(with_token)
    assert "401" in statuses and "Error401" in with_token["components"]["responses"]
    assert schemes == {"bearer"} and security == [{"bearer": []}]
    for path, method, operation in operations(with_token):
        assert ("401" in operation["responses"]) == (path not in OPEN_PATHS), (method, path)
    assert spec_errors(plain) == [] and spec_errors(with_token) == []
    assert with_token == json.loads(json.dumps(openapi_document(bearer=True)))
