// Embed sentences with a client generated at run time from the .proto file alone (no Python, no generated code).
// usage: node embed.js HOST:PORT PROTO_FILE '{"inputs": [{"text": "..."}], "layers": [], "dtype": "FLOAT32"}'
// prints JSON: {model, info: {...}, embeddings: [{tokens, offsets, shape, dtype, data_base64}]}
"use strict";
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const path = require("path");

const [target, protoFile, requestJson] = process.argv.slice(2);
const definition = protoLoader.loadSync(path.resolve(protoFile), {
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [path.dirname(path.dirname(path.dirname(path.resolve(protoFile))))],
});
const elmo = grpc.loadPackageDefinition(definition).elmo.v1;
const client = new elmo.Embedder(target, grpc.credentials.createInsecure(), {
  "grpc.max_receive_message_length": -1,
});
const deadline = () => new Date(Date.now() + 30000);

function call(method, request) {
  return new Promise((resolve, reject) =>
    client[method](request, { deadline: deadline() }, (err, response) => (err ? reject(err) : resolve(response))),
  );
}

function tensor(t) {
  if (!t) return null;
  return { shape: t.shape.map(Number), dtype: t.dtype, data_base64: Buffer.from(t.data).toString("base64") };
}

(async () => {
  const info = await call("GetModelInfo", {});
  const response = await call("Embed", JSON.parse(requestJson));
  const out = {
    model: response.model,
    info: { name: info.name, n_layers: info.n_layers, dim: info.dim, provider: info.execution_provider },
    layers: response.layers,
    embeddings: response.embeddings.map((e) => ({
      tokens: e.tokens,
      offsets: e.offsets.map((s) => [s.start, s.end]),
      layers: tensor(e.layers),
      mix: tensor(e.mix),
    })),
  };
  let error = null;
  try {
    await call("Embed", { inputs: [] });
  } catch (err) {
    error = { code: err.code, details: err.details };
  }
  out.empty_request_error = error;
  process.stdout.write(JSON.stringify(out));
  client.close();
})().catch((err) => {
  process.stderr.write(`node client failed: ${err.code} ${err.details || err.message}\n`);
  process.exit(1);
});
